"""The runner's grammar state: one llguidance matcher per guided request, and the token masks
of a step, computed on a worker thread while the step's forward pass runs.

Protocol, per step (ModelRunner.execute drives it; every call is from the stepping thread):

1. `forget(ids)` for requests finished or preempted since the last step;
2. `start_masks(rows)` right before the forward: for each row that samples this step and is
   guided, a job on the worker thread builds the request's matcher if it has none (a
   request seen for the first time, or back after a preemption: its output so far is
   replayed into the new matcher), then fills the row's bitmask. llguidance drops the GIL
   for grammar construction and mask computation, so the job runs beside the forward;
3. `take_masks()` before sampling: waits for the job; the sampler applies the masks;
4. `advance(id, token)` after sampling: the matcher consumes the sampled token.

Every public call first waits for a job still in flight, so the stepping thread never touches a
matcher while the worker does (a step cut short or failed leaves its job to the next call).

End state: once a grammar is complete and nothing may follow, the mask allows only the model's
EOS token(s); the stop rules then finish the request with finish_reason "stop" (SamplingParams
refuses ignore_eos with guided decoding for that reason).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import llguidance
import torch

from tokenweir.guided.grammar import compile_grammar
from tokenweir.guided.masks import GuidedMask, GuidedRow, bitmask_words
from tokenweir.guided.vocab import Vocabulary
from tokenweir.request import INVALID_REQUEST

# llguidance's stop reasons that mean "no token of the vocabulary continues the grammar".
DEAD_END_REASONS = frozenset({"NoExtension", "NoExtensionBias"})


@dataclass(slots=True)
class _Entry:
    grammar: str
    replay: list[int]  # output tokens to consume right after the matcher is built
    matcher: Optional[llguidance.LLMatcher] = None


@dataclass(slots=True)
class _Job:
    rows: list[int]
    req_ids: list[str]
    future: Future
    errors: dict[str, str] = field(default_factory=dict)


class GuidedDecoder:
    """`vocabulary` is called once, on the worker thread, when the first guided request is
    served: an engine that never serves one never pays for llguidance's tokenizer (~0.5 s)."""

    def __init__(self, vocabulary: Callable[[], Vocabulary], vocab_size: int,
                 num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._vocabulary = vocabulary
        self.tokenizer: Optional[llguidance.LLTokenizer] = None
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenweir-guided")
        self._entries: dict[str, _Entry] = {}
        self._job: Optional[_Job] = None
        # Probes for tests and benchmarks: rows masked so far; seconds the worker spent
        # building matchers and filling masks; seconds the stepping thread then waited for
        # it (the part the forward did not hide); the thread that filled the last masks.
        self.num_masks = 0
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0
        self.fill_thread: Optional[str] = None

    # ---- the stepping thread's calls ------------------------------------------------------
    def forget(self, req_ids) -> None:
        self._settle()
        for req_id in req_ids:
            self._entries.pop(req_id, None)

    def start_masks(self, rows: Sequence[GuidedRow]) -> None:
        """Start computing the bitmasks of `rows` (the guided rows sampled this step). A job
        left over from a step that never sampled (cut, or its forward failed) is dropped."""
        self._settle()
        self._job = None
        if not rows:
            return
        errors: dict[str, str] = {}
        for r in rows:
            if r.req_id in self._entries:
                continue
            try:
                grammar = compile_grammar(r.params)
            except ValueError as exc:  # checked when the request was made: not expected
                errors[r.req_id] = f"guided decoding failed: {exc}"
                continue
            self._entries[r.req_id] = _Entry(grammar, list(r.output_token_ids))
        ok = [r for r in rows if r.req_id not in errors]
        job = _Job([r.row for r in ok], [r.req_id for r in ok], Future(), errors)
        job.future = self._worker.submit(self._fill, job)
        self._job = job

    def take_masks(self) -> Optional[GuidedMask]:
        """The masks started by `start_masks` this step (None when no row is guided)."""
        job, self._job = self._job, None
        if job is None:
            return None
        start = time.perf_counter()
        try:
            bitmask = job.future.result()
        except Exception as exc:  # noqa: BLE001 - the step's guided requests fail, not the step
            failed = {r: f"guided decoding failed: {exc!r}" for r in job.req_ids}
            return GuidedMask([], torch.empty(0, 0, dtype=torch.int32), {**job.errors, **failed})
        finally:
            self.wait_seconds += time.perf_counter() - start
        self.num_masks += len(job.rows)
        return GuidedMask(job.rows, bitmask, job.errors)

    def advance(self, req_id: str, token_id: int) -> Optional[str]:
        """Consume the token sampled for a guided request; an error message if the grammar
        refuses it (the request must then fail), None otherwise."""
        self._settle()
        entry = self._entries.get(req_id)
        if entry is None or entry.matcher is None:
            return None
        if not entry.matcher.consume_token(token_id):
            return f"guided decoding: the grammar refused token {token_id}: " \
                   f"{entry.matcher.get_error()}"
        return None

    def is_guided(self, req_id: str) -> bool:
        return req_id in self._entries

    def close(self) -> None:
        self._settle()
        self._worker.shutdown(wait=True)

    # ---- the worker thread ------------------------------------------------------------------
    def _fill(self, job: _Job) -> torch.Tensor:
        start = time.perf_counter()
        self.fill_thread = threading.current_thread().name
        try:
            return self._fill_rows(job)
        finally:
            self.fill_seconds += time.perf_counter() - start

    def _fill_rows(self, job: _Job) -> torch.Tensor:
        """The rows' bitmasks; a request whose matcher is in error (before or while its mask
        is filled) gets its message in `job.errors` and an unconstrained row (an all-forbidden
        row must not reach the sampler; the runner fails the request instead)."""
        bitmask = torch.full((len(job.rows), bitmask_words(self.vocab_size)), -1,
                             dtype=torch.int32)
        ready = []
        for i, req_id in enumerate(job.req_ids):
            matcher = self._matcher(self._entries[req_id])
            if matcher.is_error():
                job.errors[req_id] = matcher_failure(matcher)
            else:
                ready.append((matcher, i))
        if ready:
            fill_bitmask_rows(self._executor, ready, bitmask)
            for matcher, i in ready:
                if matcher.is_error():
                    job.errors[job.req_ids[i]] = matcher_failure(matcher)
                    bitmask[i] = -1
        return bitmask

    def _matcher(self, entry: _Entry) -> llguidance.LLMatcher:
        if self.tokenizer is None:
            self.tokenizer = llguidance_tokenizer(self._vocabulary())
        if entry.matcher is None:
            entry.matcher = llguidance.LLMatcher(self.tokenizer, entry.grammar, log_level=0)
            if entry.replay:
                entry.matcher.consume_tokens(entry.replay)
            entry.replay = []
        return entry.matcher

    def _settle(self) -> None:
        """Wait for a job in flight (its result is dropped if nobody took it)."""
        job = self._job
        if job is not None and not job.future.done():
            job.future.exception()  # waits; an exception is the taker's to see


def matcher_failure(matcher: llguidance.LLMatcher) -> str:
    """Why a request whose matcher is in error fails. A grammar that no token of this
    vocabulary can continue (it needs bytes no token spells: SmolLM2 has none for 0xF1, the
    first byte of U+40000 to U+7FFFF) is the request's fault: an INVALID_REQUEST message (HTTP
    400). Anything else is the server's (500)."""
    reason = matcher.get_error().split("\n", 1)[0]  # stop_reason() says "InternalError"
    if reason in DEAD_END_REASONS:
        return f"{INVALID_REQUEST}: guided_decoding: no token of this model can continue the " \
               f"grammar here ({reason}: it needs bytes the model's vocabulary does not spell)"
    return f"guided decoding failed: {matcher.get_error()}"


def fill_bitmask_rows(executor: llguidance.LLExecutor,
                      matchers: Sequence[tuple[llguidance.LLMatcher, int]],
                      bitmask: torch.Tensor) -> None:
    """Fill row `i` of `bitmask` (int32, CPU, contiguous) with matcher's next-token mask for
    each (matcher, i), on llguidance's threads: what `llguidance.torch.
    fill_next_token_bitmask_par` does, without importing that module, whose
    `@torch.compile` decorator imports torch._dynamo at import (2-5 s on the first guided
    request of every process, a served one included)."""
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or bitmask.dim() != 2:
        raise ValueError("a guided bitmask is a 2-D int32 tensor on the CPU")
    if not bitmask.is_contiguous():
        raise ValueError("a guided bitmask must be contiguous")
    batch, words = bitmask.shape
    executor.unsafe_compute_mask_ptr(list(matchers), bitmask.data_ptr(), words * 4, batch)


class _Wrapper:
    """What llguidance.TokenizerWrapper reads: token bytes (special tokens as 0xFF + name),
    EOS, and a tokenize function."""

    def __init__(self, vocabulary: Vocabulary, names: Sequence[str]) -> None:
        self.eos_token_id = min(vocabulary.stop_ids) if vocabulary.stop_ids else None
        self.bos_token_id = None
        self.tokens = [b"\xff" + names[i].encode() if i in vocabulary.special_ids else b
                       for i, b in enumerate(vocabulary.token_bytes)]
        self.special_token_ids = sorted(vocabulary.special_ids)
        self._encode = vocabulary.encode
        self._byte_token: dict[int, int] = {}  # byte -> the first token spelling it alone
        for i, b in enumerate(vocabulary.token_bytes):
            if len(b) == 1 and i not in vocabulary.special_ids:
                self._byte_token.setdefault(b[0], i)
        self._spelled = bytes(sorted(self._byte_token))

    def __call__(self, text: bytes | str) -> list[int]:
        """Tokens whose bytes are exactly the longest prefix of `text` this vocabulary can
        spell: the tokenizer's own split where it spells the prefix exactly, else one token
        per byte. llguidance takes the bytes the ids spell as the text's (for forced bytes):
        a byte dropped here (the tokenizer drops one it has no token for) became a mask that
        allowed the wrong token and a grammar error mid-request."""
        data = text.encode() if isinstance(text, str) else text
        unspelled = data.translate(None, self._spelled)
        if unspelled:
            data = data[:data.index(unspelled[0])]
        ids = self._encode(data.decode("utf-8", errors="replace"))
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return [self._byte_token[b] for b in data]


def llguidance_tokenizer(vocabulary: Vocabulary) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer, built from its vocabulary (about 0.5 s for 49k
    tokens); every stop id ends a complete grammar."""
    names = [f"<|special_{i}|>" for i in range(vocabulary.size)]
    for i, name in vocabulary.special_names.items():
        names[i] = name
    wrapper = llguidance.TokenizerWrapper(_Wrapper(vocabulary, names))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocabulary.size,
                                  eos_token=sorted(vocabulary.stop_ids) or None)
