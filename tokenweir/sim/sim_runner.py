"""The simulator's model runner: no model, no torch; tokens by rule, time by a latency model.

`SimRunner.execute(scheduler_output)` honours the runner contract of core/outputs.py exactly as
the real runner does: new requests arrive in full (re-admitted ones too), cached ones as diffs,
and finished or preempted ids are forgotten. A request samples a token exactly when a step
brings its computed tokens up to the tokens the runner knows for it. The sampled token is EOS
when that output reaches the request's target length (`target_output_len`), otherwise a
deterministic non-EOS id. The step's duration comes from the latency model, given each
request's cached context before the step.

Decoding requests (they have sampled, and owe exactly one token) take a fast path: the runner
keeps one small int for each, the regular samples left before EOS (`_left`), and takes a row's
context from the output's `cached_num_computed_tokens` (the runner's own count, by the
contract), its position from that and its token by rule. A step then touches one dict entry per
decoding request, not an object and the int objects it held: in a 64-instance cluster every
instance's requests have gone cold between two of its steps, and those touches were most of the
runner's time. Prefilling requests, and all requests on a step with `check`, `keep_undo` (a cut
must be undone), a sliding window or a latency model without `predict_totals`, take the
per-row path (`_Tracked`).
"""

from __future__ import annotations

from functools import lru_cache
from math import gcd
from typing import Mapping, Optional

from tokenweir.core.kv_cache_manager import block_key_packer, block_tokens_key
from tokenweir.core.outputs import CutReport, ModelRunnerOutput, SchedulerOutput
from tokenweir.sim.latency import StepTotals

DEFAULT_EOS = 2
_FIRST_REGULAR_TOKEN = 3
_TOKEN_STRIDE = 7919  # regular token at position k: FIRST + (k * STRIDE + len(id)) % span
_NEVER = float("inf")  # eos_at of a request without a target: EOS is never sampled
_UNBOUNDED = 1 << 40  # regular samples left for a decoding request without a target


@lru_cache(maxsize=None)
def shared_token_lists(vocab_size: int) -> list[list[int]]:
    """[[0], [1], ..., [vocab_size - 1]], one per vocabulary size for the whole process: a
    step's sampled token as `ModelRunnerOutput.sampled_token_ids` holds it (read-only). The
    regular ids' int objects are `shared_token_walk`'s."""
    objects: list[int] = list(range(vocab_size))
    walk = shared_token_walk(vocab_size)
    for token in walk[:len(walk) // 2]:
        objects[token] = token
    return [(t,) for t in objects]


@lru_cache(maxsize=None)
def shared_token_walk(vocab_size: int) -> list[int]:
    """The regular token ids in the order consecutive positions sample them: entry m is
    FIRST + (m * STRIDE) % span, for m in [0, 2 * span) (the sequence repeats every span
    entries; empty when STRIDE and span share a factor: it would not cover every id). A
    request id of length L samples at position k entry (k + L * STRIDE^-1) % span (mod span),
    so a run of up to span positions is one slice. Its int objects are made here one after
    another, in this order, and are THE objects of these ids in the process
    (`shared_token_lists` holds them): a run of positions then touches neighbouring objects
    (extending a token list increments each one's count), not one scattered object each."""
    span = vocab_size - _FIRST_REGULAR_TOKEN
    if span < 1 or gcd(_TOKEN_STRIDE, span) != 1:
        return []
    values = [_FIRST_REGULAR_TOKEN + (m * _TOKEN_STRIDE) % span for m in range(span)]
    walk = [v + 0 for v in values]  # fresh objects (CPython), allocated in walk order
    return walk + walk


@lru_cache(maxsize=None)
def shared_regular_samples(vocab_size: int) -> list[tuple[int]]:
    """`shared_token_lists(vocab_size)[FIRST:]`, the regular samples, also one list for the
    whole process: a copy per runner (256 KB of pointers at 32k tokens) is read at a random
    index per decoded token, and 64 copies in a cluster miss the caches at each read."""
    return shared_token_lists(vocab_size)[_FIRST_REGULAR_TOKEN:]


@lru_cache(maxsize=None)
def shared_regular_ids(vocab_size: int) -> list[int]:
    """The ints of `shared_regular_samples(vocab_size)` (the same objects)."""
    return [sample[0] for sample in shared_regular_samples(vocab_size)]


@lru_cache(maxsize=None)
def shared_block_keys(vocab_size: int, block_size: int) -> list:
    """Walk offset m -> the prefix-cache key ids (`block_tokens_key`) of the `block_size`
    regular ids `shared_token_walk(vocab_size)[m:m + block_size]` (None until a block at that
    offset is published): one table for the whole process (a runner's rows fill blocks at
    every offset)."""
    return [None] * (vocab_size - _FIRST_REGULAR_TOKEN)


class RegularBlockKeys:
    """A runner's block-key rule (`SimRunner.regular_block_rule`): called as (request, k), and
    in its table form, which a decode stretch reads per row (core/sched/decode_stretch.py's
    TableBlockKeyRule): block k of a request is keyed by
    `table[(k * block_size + offset) % period]` (`make(start)` where that is None) for every
    k >= first, where (first, offset) = `row(request)`; blocks before `first` hold a prompt
    position (no key)."""

    __slots__ = ("_walk", "period", "block_size", "_inverse", "table", "_pack")

    def __init__(self, walk: list[int], span: int, block_size: int, inverse_stride: int,
                 table: list) -> None:
        self._walk, self.period, self.block_size = walk, span, block_size
        self._inverse, self.table = inverse_stride, table
        self._pack = block_key_packer(block_size)

    def row(self, request) -> tuple[int, int]:
        """(the first block holding no prompt position, the row's walk offset)."""
        first = -(-len(request.prompt_token_ids) // self.block_size)
        return first, len(request.request_id) * self._inverse % self.period

    def make(self, start: int):
        """The key ids at walk offset `start`, made once and kept in the table."""
        ids = self.table[start] = block_tokens_key(self._pack,
                                                   self._walk[start:start + self.block_size])
        return ids

    def __call__(self, request, k: int):
        position = k * self.block_size
        if position < len(request.prompt_token_ids):  # num_prompt_tokens, without a call
            return None
        start = (position + len(request.request_id) * self._inverse) % self.period
        return self.table[start] or self.make(start)


class _Tracked:
    """The runner's state of one request: `computed` tokens whose KV it has written, `known`
    tokens (prompt + outputs so far), `eos_at` (the `known` count at which the next sample is
    EOS: prompt + target - 1), `next` (the regular token id at position `known`, see
    `_regular_token`, stepped along). One slotted object: one allocation, a few cache lines."""

    __slots__ = ("computed", "known", "eos_at", "next")

    def __init__(self, computed: int, known: int, eos_at: float, next_token: int) -> None:
        self.computed, self.known, self.eos_at, self.next = computed, known, eos_at, next_token

    def saved(self) -> tuple:
        return self.computed, self.known, self.eos_at, self.next

    def restore(self, saved: tuple) -> None:
        self.computed, self.known, self.eos_at, self.next = saved


class SimRunner:
    def __init__(self, latency_model, target_output_len: Optional[Mapping[str, int]] = None,
                 eos_token_id: int = DEFAULT_EOS, vocab_size: int = 32000,
                 check: bool = False) -> None:
        self.latency_model = latency_model
        # A sliding-window model attends at most this many cached tokens: the step's context
        # sums count min(c, window) (RooflineLatencyModel.attention_window; inf: no window).
        self._window = getattr(latency_model, "attention_window", None) or float("inf")
        # request id -> output length at which EOS is sampled; the caller may add to it later
        self.target_output_len = target_output_len if target_output_len is not None else {}
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.check = check  # assert the contract (tests); off on the hot path
        # Per tracked request, its state (one lookup per request per step); the target is
        # read when the request (re)arrives in `scheduled_new_reqs`.
        self._state: dict[str, _Tracked] = {}
        # Decoding requests on the fast path instead (not in `_state`): regular samples left
        # before EOS (eos_at - known, <= 0: the next sample is EOS), and (known, left, eos_at)
        # when they came to it, which give `known` back: known + (that left - left now).
        self._left: dict[str, int] = {}
        self._base: dict[str, tuple[int, int, float]] = {}
        # A request's sampled tokens, as `_advance` returns them: one shared, read-only
        # one-element list per token id (no list made per request per step). Its int is one
        # object per token id for every runner of the process: requests' token lists and the
        # prefix cache's block keys then refer to a few hot objects, not millions (nor a copy
        # per instance of a cluster).
        self._samples = shared_token_lists(vocab_size)
        self._eos_sample = self._samples[eos_token_id] if 0 <= eos_token_id < vocab_size \
            else (eos_token_id,)
        # position k's regular sample is this list's [(k * STRIDE + len(id)) % span]
        self._regular_samples = shared_regular_samples(vocab_size)
        self._regular_ids = shared_regular_ids(vocab_size)  # the same ints, unwrapped
        self._walk = shared_token_walk(vocab_size)  # the same ints, in sampling order
        self._inverse_stride = pow(_TOKEN_STRIDE, -1, len(self._regular_ids)) \
            if self._walk else 0
        self.num_blocks: dict[str, int] = {}  # block-table lengths, tracked only with `check`
        # Mid-step cuts (slo policy): keep what the last step advanced, so `cut` can undo it.
        self.keep_undo = False
        self._undo: dict[str, tuple[int, int, int]] = {}

    @property
    def computed(self) -> dict[str, int]:
        """Request id -> tokens whose KV the runner has written (a copy, for inspection)."""
        return {**{rid: st.computed for rid, st in self._state.items()},
                **{rid: known - 1 for rid, known in self._fast_known()}}

    @property
    def known(self) -> dict[str, int]:
        """Request id -> tokens the runner knows: prompt + outputs so far (a copy)."""
        return {**{rid: st.known for rid, st in self._state.items()},
                **dict(self._fast_known())}

    @property
    def num_tracked(self) -> int:
        return len(self._state) + len(self._left)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(out.finished_req_ids)
        self._forget(out.preempted_req_ids)
        self._track_new(out)
        state = self._state
        if self.check:
            self._check_cached(out)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput(sampled_token_ids={}, step_seconds=0.0)
        predict_totals = getattr(self.latency_model, "predict_totals", None)
        fast = self._fast_path_for(out, predict_totals)
        if self._left and not fast:
            self._leave_fast_path()
        if self.keep_undo:
            self._undo = {rid: state[rid].saved() for rid in out.num_scheduled_tokens}
        if predict_totals is None:  # a model that needs the whole step
            context = {rid: state[rid].computed for rid in out.num_scheduled_tokens}
            seconds = self.latency_model.predict(out, context)  # context before advancing
            sampled, _ = self._advance(out, fast)
        else:  # the step's sums are gathered while advancing: one pass over the batch
            sampled, totals = self._advance(out, fast)
            seconds = predict_totals(totals)
        return ModelRunnerOutput(sampled_token_ids=sampled, step_seconds=seconds)

    def _track_new(self, out: SchedulerOutput) -> None:
        """Per-row state for each request the output brings in full (new or re-admitted)."""
        state, targets = self._state, self.target_output_len
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            if self._base.pop(rid, None) is not None:  # never without a _forget first
                del self._left[rid]
            target = targets.get(rid)
            eos_at = _NEVER if target is None else new.num_prompt_tokens + target - 1
            known = len(new.token_ids)
            state[rid] = _Tracked(new.num_computed_tokens, known, eos_at,
                                  self._regular_token(rid, known))
            if self.check:
                self.num_blocks[rid] = len(new.block_ids)

    def _check_cached(self, out: SchedulerOutput) -> None:
        """The scheduler's view of each running request matches the runner's."""
        for cached in out.scheduled_cached_reqs:
            rid = cached.req_id
            computed = self._state[rid].computed
            assert computed == cached.num_computed_tokens, (
                f"{rid}: runner has {computed} computed, scheduler says "
                f"{cached.num_computed_tokens}")
            self.num_blocks[rid] += len(cached.new_block_ids)

    def cut(self, out: SchedulerOutput, step_seconds: float, layer_index: int, num_layers: int,
            victim_id: str, waiter_id: Optional[str] = None) -> ModelRunnerOutput:
        """The last executed step (`out`, predicted to take `step_seconds`) is cut before layer
        `layer_index`: undo its advance and samples, as the real runner never makes them, and
        report the cut. The step lasted layer_index / num_layers of its time."""
        for rid, saved in self._undo.items():
            self._state[rid].restore(saved)
        self._undo = {}
        return ModelRunnerOutput(
            sampled_token_ids={}, step_seconds=step_seconds * layer_index / num_layers,
            cut=CutReport(out.step_id, layer_index, num_layers, victim_id, waiter_id))

    def _regular_token(self, rid: str, k: int) -> int:
        """The deterministic non-EOS token id sampled at position k of request `rid`."""
        span = self.vocab_size - _FIRST_REGULAR_TOKEN
        return _FIRST_REGULAR_TOKEN + (k * _TOKEN_STRIDE + len(rid)) % span

    def _forget(self, request_ids) -> None:
        state, left, base = self._state, self._left, self._base
        for rid in request_ids:
            if state.pop(rid, None) is None and base.pop(rid, None) is not None:
                del left[rid]
            self.num_blocks.pop(rid, None)

    # ---- decode stretches (sim/decode_stretch.py) --------------------------------------------
    def forget(self, request_ids) -> None:
        """Drop finished or preempted requests, as `execute` does with an output's ids."""
        self._forget(request_ids)

    def decoding_left(self, rid: str) -> Optional[int]:
        """Regular samples `rid` has left before EOS on the fast path (<= 0: its next sample is
        EOS), or None when it is not on the fast path."""
        return self._left.get(rid)

    def advance_decoding(self, rid: str, num_steps: int) -> None:
        """`rid`, on the fast path, decoded `num_steps` steps that `execute` did not see (a
        stretch advanced them): as if it had."""
        self._left[rid] -= num_steps

    def regular_token_ids(self, request, computed: int, count: int) -> list[int]:
        """The tokens `count` decode steps sample for `request` from `computed` computed tokens
        on, none of them EOS (the caller knows): the shared int objects `_advance` samples,
        `_regular_samples[((c + 1) * STRIDE + len(id)) % span]` for each computed count c:
        one slice of `shared_token_walk` (or, where it is empty or the run longer than its
        period, position by position)."""
        walk, span = self._walk, len(self._regular_ids)
        first = computed + 1
        if walk and count <= span:
            start = (first + len(request.request_id) * self._inverse_stride) % span
            return walk[start:start + count]
        ids, offset = self._regular_ids, len(request.request_id)
        return [ids[(k * _TOKEN_STRIDE + offset) % span] for k in range(first, first + count)]

    def regular_block_rule(self, block_size: int) -> Optional["RegularBlockKeys"]:
        """(request, k) -> the key ids (`block_tokens_key`) of the request's block k when every
        one of its `block_size` tokens is a regular output sample (positions past the prompt,
        none of them EOS: the caller knows), as `regular_token_ids` gives them, without its
        token list; None where a position is the prompt's. None (no rule) where the walk is
        empty or shorter than a block. The rule also has its table form (RegularBlockKeys)."""
        walk, span = self._walk, len(self._regular_ids)
        if not walk or block_size > span:
            return None
        return RegularBlockKeys(walk, span, block_size, self._inverse_stride,
                                shared_block_keys(self.vocab_size, block_size))

    def execute_beside(self, out: SchedulerOutput, num_decodes: int,
                       decode_context: int) -> ModelRunnerOutput:
        """`execute` of a step whose output lists only some of its requests (new ones, and
        running ones after a decode stretch's rows), beside `num_decodes` decoding requests on
        the fast path that the stretch advances itself (their computed tokens summing to
        `decode_context`): the same forgetting, samples and state as `execute` of the whole
        step on the fast path, and the whole step's time (the rows counted in its sums).
        Only where `fast_path_possible`."""
        self._forget(out.finished_req_ids)
        self._forget(out.preempted_req_ids)
        self._track_new(out)
        predict_totals = self.latency_model.predict_totals
        assert self._fast_path_for(out, predict_totals), "a stretch stands only on the fast path"
        sampled, totals = self._advance(out, True, num_decodes, decode_context)
        return ModelRunnerOutput(sampled_token_ids=sampled, step_seconds=predict_totals(totals))

    def fast_path_possible(self) -> bool:
        """Whether a step may ever take the decoding fast path (`_fast_path_for`'s standing
        conditions)."""
        return (not self.check and not self.keep_undo and self._window == _NEVER
                and getattr(self.latency_model, "predict_totals", None) is not None)

    # ---- the decoding fast path --------------------------------------------------------------
    def _fast_path_for(self, out: SchedulerOutput, predict_totals) -> bool:
        """Whether a step may take the fast path: nothing needs per-row state (checks, cut
        undos, windowed contexts, a whole-step latency model), and the output lists every
        running request it schedules in `cached_req_ids` (their contexts are read there)."""
        return (not self.check and not self.keep_undo and self._window == _NEVER
                and predict_totals is not None
                and len(out.cached_req_ids) + len(out.scheduled_new_reqs)
                == len(out.num_scheduled_tokens))

    def _start_decoding(self, rid: str, known: int, eos_at: float) -> None:
        """`rid` (computed == known - 1 after sampling) leaves `_state` for the fast path."""
        left = _UNBOUNDED if eos_at == _NEVER else int(eos_at) - known
        del self._state[rid]
        self._left[rid] = left
        self._base[rid] = (known, left, eos_at)

    def _fast_known(self):
        """(request id, known) of each request on the fast path."""
        left = self._left
        return ((rid, known + start - left[rid]) for rid, (known, start, _) in self._base.items())

    def _leave_fast_path(self) -> None:
        """Back to per-row state for every request (a step the fast path cannot take)."""
        for rid, known in list(self._fast_known()):
            eos_at = self._base[rid][2]
            self._state[rid] = _Tracked(known - 1, known, eos_at, self._regular_token(rid, known))
        self._left.clear()
        self._base.clear()

    def _advance(self, out: SchedulerOutput, fast: bool, beside: int = 0,
                 beside_context: int = 0) -> tuple[dict[str, list[int]], StepTotals]:
        """Advance computed counts, sample where a step reaches the known tokens, and sum the
        step's shape for the latency model (context = computed before the step, capped at the
        model's sliding window): with `fast` (`_fast_path_for` this step; without it no
        request is on the fast path), decoding requests on the fast path, the others row by
        row; with `fast`, `beside` more decoding requests the output does not list (a decode
        stretch's rows, computed tokens summing to `beside_context`) are counted in the
        sums."""
        scheduled = out.num_scheduled_tokens
        sampled: dict[str, list[int]] = {}
        if not fast:
            return sampled, self._totals(len(scheduled), 0,
                                         self._advance_rows(scheduled.items(), sampled, False))
        state, left_of = self._state, self._left
        get = scheduled.get
        rows = {rid: n for rid in state if (n := get(rid)) is not None} if state else None
        # Each decoding request computes its one owed token (context c) and samples position
        # c + 1: EOS when no regular sample is left, else its regular token.
        regular, eos, span = self._regular_samples, self._eos_sample, len(self._regular_samples)
        row_context = 0  # of the cached requests not on the fast path
        for rid, c in zip(out.cached_req_ids, out.cached_num_computed_tokens):
            left = left_of.get(rid)
            if left is None:
                row_context += c
                continue  # prefilling: a row of its own
            sampled[rid] = regular[((c + 1) * _TOKEN_STRIDE + len(rid)) % span] \
                if left > 0 else eos
            left_of[rid] = left - 1
        decode_context = sum(out.cached_num_computed_tokens) - row_context + beside_context
        sums = self._advance_rows(rows.items(), sampled, True) if rows else _NO_ROWS
        return sampled, self._totals(len(scheduled) + beside, decode_context, sums)

    @staticmethod
    def _totals(num_scheduled: int, decode_context: int, sums: tuple) -> StepTotals:
        """The step's StepTotals from the per-row pass's `sums` and the `decode_context` of
        the other rows (each computing one token)."""
        tokens, rows, context, q_context, q_squared, row_decode_context = sums
        num_decodes = num_scheduled - rows
        decode_context += row_decode_context
        return StepTotals(tokens + num_decodes, rows + num_decodes, num_decodes,
                          context + decode_context, q_context + decode_context,
                          q_squared + num_decodes, decode_context)

    def _advance_rows(self, items, sampled: dict[str, list[int]], fast: bool) -> tuple:
        """The per-row pass over (request id, tokens) `items`, sampling into `sampled`;
        returns (tokens, rows, context, q * context, q * q) over the rows computing more than
        one token and the context over those computing one. With `fast`, a request that
        samples (it then owes exactly one token) moves to the fast path.

        The token at position k (0-based over prompt + output) is EOS when it is the
        target-th output token or later, else `_regular_token(rid, k)`, stepped from position
        k - 1's: + stride, wrapped into [FIRST, FIRST + span) (stride % span < span)."""
        state, eos, samples, window = (self._state, self._eos_sample, self._samples,
                                       self._window)
        windowed = window != _NEVER
        span = self.vocab_size - _FIRST_REGULAR_TOKEN
        stride, end = _TOKEN_STRIDE % span, _FIRST_REGULAR_TOKEN + span
        decode_context = 0  # over q == 1 rows, summed apart: the common, cheap case
        tokens = rows = context = q_context = q_squared = 0  # over the other rows
        for rid, n in items:
            st = state[rid]
            c = st.computed
            done = c + n
            st.computed = done
            if windowed and c > window:
                c = window
            if n == 1:
                decode_context += c
            else:
                tokens += n
                rows += 1
                context += c
                q_context += n * c
                q_squared += n * n
            k = st.known
            if done == k:
                regular = st.next
                # EOS: this is the target-th output token, or later
                sampled[rid] = eos if k >= st.eos_at else samples[regular]
                regular += stride
                st.next = regular - span if regular >= end else regular
                st.known = k + 1
                if fast:
                    self._start_decoding(rid, k + 1, st.eos_at)
            elif self.check:
                assert done < k, f"{rid}: computed {done} past the {k} known tokens"
        return tokens, rows, context, q_context, q_squared, decode_context


_NO_ROWS = (0, 0, 0, 0, 0, 0)
