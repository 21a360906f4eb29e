"""Response bodies of /v1/completions and /v1/chat/completions, whole and streamed.

One `Shape` per endpoint says how a choice looks; the loop that folds the engine's delta
outputs into chunks (`stream_chunks`) and the one that collects a whole answer (`collect`) are
shared. Contract of a stream: zero or more opening chunks, then per choice (`index`; n of them
with parallel sampling) one chunk per engine step that produced text or tokens for it, its
last carrying its finish_reason, then (with include_usage) a usage chunk with no choices:
the prompt's tokens once, the completion tokens of every choice. A request that failed in the
engine (finish_reason "error") then gets one `{"error": {...}}` event with the engine's message
(as vLLM sends it) before [DONE]; not streamed, it is answered with that error: 500, or 400 when
the engine refused it as invalid.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from tokenweir.outputs import RequestOutput
from tokenweir.server import protocol as P
from tokenweir.server.tool_calls import ToolCallStream, parse_tool_calls, stream_deltas


class Shape:
    """What completions and chat have in common: the envelope of every body and chunk."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, parsed: P.Parsed, tokenizer: Any) -> None:
        self.request_id, self.model, self.parsed = request_id, model, parsed
        self.tokenizer, self.k = tokenizer, parsed.top_logprobs
        self.created = P.now()

    def envelope(self, choices: list, object_name: str, **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def chunk(self, choices: list, **extra: Any) -> dict:
        if self.parsed.include_usage and "usage" not in extra:
            extra["usage"] = None
        return self.envelope(choices, self.chunk_object_name, **extra)

    def whole(self, choices: P.Choices, entries: dict[int, list]) -> dict:
        self.created = P.now()
        return self.envelope([self.whole_choice(acc, entries.get(acc.index, []))
                              for acc in choices.in_order()], self.object_name,
                             usage=choices.usage())

    def usage_chunk(self, choices: P.Choices) -> dict:
        return self.chunk([], usage=choices.usage())

    # ---- per endpoint -----------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        return []

    def delta_choice(self, acc: P.Accumulator, text: str, token_ids: list[int], entries: list,
                     finished: bool) -> dict:
        raise NotImplementedError

    def whole_choice(self, acc: P.Accumulator, entries: list) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any, echo: Optional[str] = None) -> None:
        super().__init__(*args)
        self.echo = echo  # the prompt text, when the client asked for it back
        self.offsets: dict[int, int] = {}  # choice -> characters streamed (text_offset)

    def _logprobs(self, token_ids: list[int], entries: list, offset: int) -> Optional[dict]:
        if self.k is None:
            return None
        return P.completion_logprobs(self.tokenizer, token_ids, entries, self.k, offset)

    def delta_choice(self, acc, text, token_ids, entries, finished) -> dict:
        offset = self.offsets.get(acc.index, 0)
        choice = {"index": acc.index, "text": text,
                  "logprobs": self._logprobs(token_ids, entries, offset),
                  "finish_reason": acc.finish_reason if finished else None,
                  "stop_reason": acc.stop_reason if finished else None}
        self.offsets[acc.index] = offset + len(text)
        return choice

    def whole_choice(self, acc, entries) -> dict:
        return {"index": acc.index, "text": (self.echo or "") + acc.text,
                "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
                "logprobs": self._logprobs(acc.token_ids, entries, 0)}


class ChatShape(Shape):
    """With `tool_calls`, the generated text is parsed for tool calls (server/tool_calls.py):
    a whole answer gets `message.tool_calls` and finish_reason "tool_calls"; a stream holds
    back the text from `<tool_call>` on and sends the parsed calls in its final chunk."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, tool_calls: bool = False,
                 parallel_tool_calls: bool = True) -> None:
        super().__init__(*args)
        self.parallel_tool_calls = parallel_tool_calls
        self.tool_calls = tool_calls
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its filter

    def _logprobs(self, token_ids: list[int], entries: list) -> Optional[dict]:
        if self.k is None:
            return None
        return P.chat_logprobs(self.tokenizer, token_ids, entries, self.k)

    def opening_chunks(self) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for i in range(self.parsed.params.n)]

    def _tool_stream(self, index: int) -> Optional[ToolCallStream]:
        """The tool-call filter of choice `index` (each of n choices parses its own text)."""
        if not self.tool_calls:
            return None
        if index not in self._tool_streams:
            self._tool_streams[index] = ToolCallStream(self.parallel_tool_calls)
        return self._tool_streams[index]

    def delta_choice(self, acc, text, token_ids, entries, finished) -> dict:
        calls: list[dict] = []
        tool_stream = self._tool_stream(acc.index)
        if tool_stream is not None:
            text = tool_stream.feed(text)
            if finished:
                rest, calls = tool_stream.finish()
                text += rest
        delta: dict = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = stream_deltas(calls)
        choice = {"index": acc.index, "delta": delta,
                  "logprobs": self._logprobs(token_ids, entries),
                  "finish_reason": ("tool_calls" if calls else acc.finish_reason)
                  if finished else None}
        if finished:
            choice["stop_reason"] = acc.stop_reason
        return choice

    def whole_choice(self, acc, entries) -> dict:
        message: dict = {"role": "assistant", "content": acc.text}
        finish_reason = acc.finish_reason
        if self.tool_calls:
            parsed = parse_tool_calls(acc.text, self.parallel_tool_calls)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": parsed.tool_calls}
                finish_reason = "tool_calls"
        return {"index": acc.index, "message": message, "finish_reason": finish_reason,
                "stop_reason": acc.stop_reason,
                "logprobs": self._logprobs(acc.token_ids, entries)}


async def stream_chunks(shape: Shape, outputs: AsyncIterator[RequestOutput]
                        ) -> AsyncIterator[dict]:
    """The chunks of a streamed answer (see the module contract)."""
    for chunk in shape.opening_chunks():
        yield chunk
    choices = P.Choices()
    async for out in outputs:
        for completion in out.outputs:
            acc = choices.of(completion.index)
            text, token_ids, entries = acc.add(out, completion)
            if not text and not token_ids and not acc.finished:
                continue
            yield shape.chunk([shape.delta_choice(acc, text, token_ids, entries, acc.finished)])
    if shape.parsed.include_usage:
        yield shape.usage_chunk(choices)
    failed = choices.failed()
    if failed is not None:  # after the final chunk (finish_reason "error"), before [DONE]
        yield failed.body()


async def collect(shape: Shape, outputs: AsyncIterator[RequestOutput]) -> dict:
    """The whole answer of a request that was not streamed."""
    choices = P.Choices()
    entries: dict[int, list] = {}
    async for out in outputs:
        for completion in out.outputs:
            _, _, new = choices.of(completion.index).add(out, completion)
            entries.setdefault(completion.index, []).extend(new)
    failed = choices.failed()
    if failed is not None:  # a 500 (or 400) with the engine's message, not a 200
        raise failed
    return shape.whole(choices, entries)
