"""Tool calling on /v1/chat/completions: which tools reach the chat template, and the
Hermes-style parser that turns generated text into OpenAI's `message.tool_calls`.

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes 2 Pro, Qwen 2.5/3, and the templates that copy them; vLLM's `hermes` parser). Text
before the first `<tool_call>` is the message content. If any call is not such a JSON object,
nothing is parsed: the whole text is content, as vLLM does.

Contract of `tools_for_template`: the tools to render, or None when the template must not see
any (no tools, or tool_choice "none": then nothing is parsed either, and it works with every
template). APIError(400) for tools on a template that does not take them, for a tool_choice
without tools, and for "required" / a named function (they need structured output, which
tokenweir does not force for tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.server.errors import APIError

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def tools_for_template(req: Any, template_takes_tools: bool) -> Optional[list[dict]]:
    """The request's tools as plain dicts for the chat template, or None (see the module)."""
    choice = req.tool_choice
    if not req.tools:
        if choice in (None, "none"):
            return None
        raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "none":
        return None
    if choice != "auto" and choice is not None:
        shown = choice if isinstance(choice, str) else "a named function"
        raise APIError(f"tool_choice {shown!r} is not supported by tokenweir (it would need the "
                       "output forced into a call); use 'auto' or 'none'", param="tool_choice")
    if not template_takes_tools:
        raise APIError("this model's chat template does not take tools, so tool calling is "
                       "unavailable with it (send tool_choice 'none' or no tools)",
                       param="tools")
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


@dataclass(slots=True)
class ParsedOutput:
    content: Optional[str]  # None when the text holds nothing but calls
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's shape, ids included


def parse_tool_calls(text: str, parallel: bool = True) -> ParsedOutput:
    """Content and tool calls of a whole generated text (see the module docstring).
    `parallel=False` keeps the first call only (OpenAI's parallel_tool_calls)."""
    if START not in text:
        return ParsedOutput(content=text)
    calls = []
    for closed, unclosed in _CALL.findall(text):
        call = _call_of((closed or unclosed).strip())
        if call is None:
            return ParsedOutput(content=text)
        calls.append(call)
    content = text[:text.index(START)]
    return ParsedOutput(content=content if content.strip() else None,
                        tool_calls=calls if parallel else calls[:1])


def _call_of(body: str) -> Optional[dict]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


class ToolCallStream:
    """Streams a generation's content while holding back everything from the first
    `<tool_call>` on (and any tail that might be its beginning); `finish()` parses the
    whole text and gives the content not yet sent and the calls, for the final chunk."""

    def __init__(self, parallel: bool = True) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content
        self.parallel = parallel

    def feed(self, delta: str) -> str:
        """Content that is safe to stream now."""
        self.text += delta
        start = self.text.find(START)
        safe = start if start >= 0 else len(self.text) - _partial_start(self.text)
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, tool calls) once the generation is over."""
        parsed = parse_tool_calls(self.text, self.parallel)
        if not parsed.tool_calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        content = parsed.content or ""
        rest = content[self.sent:] if len(content) > self.sent else ""
        self.sent = len(self.text)
        return rest, parsed.tool_calls


def _partial_start(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of START."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def stream_deltas(calls: list[dict]) -> list[dict]:
    """Tool calls as a streamed delta carries them (each with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def arguments_as_objects(tool_calls: list[dict]) -> list[dict]:
    """An assistant message's tool_calls for a chat template: `arguments` strings parsed to
    objects (templates render them with tojson), as vLLM does; non-JSON strings kept."""
    out = []
    for call in tool_calls:
        function = dict(call.get("function") or {})
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except ValueError:
                pass
        out.append({**call, "function": function})
    return out
