"""A decode stretch: consecutive steps of one Scheduler in which a prefix of the running list
(the rows) provably decodes one token each and nothing else, advanced by touching only the rows
that have something to do in a step; the requests after them (the tail: prefills, and decodes
behind a prefill) and the waiting ones go through the scheduler's real passes. The simulator's
fast path (sim/decode_stretch.py drives it); torch-free, the KV manager through its public API.

Entry (`DecodeStretch.enter`, with rows from `eligible_rows`: the leading running requests
that are plain decodes): the rows fit the token budget; each row owes exactly one token and has
sampled its first (a decode), has a fast length cap (no stop token ids), is no
parallel-sampling sample, and if ever preempted is at its high-water mark (it recomputes
nothing more); no registration lags (no swap-out behind); no fresh fork; prefills are not
prioritized and the policy's per-step hooks are the base (fcfs) no-ops.

Contract. While `can_continue()` holds, step j (0-based from entry) of the stretch does exactly
what `schedule()` then `update_from_output()` do for such a step, in their order:
  plan (`plan_step`): each row whose computed tokens end on a block boundary gets
    `allocate_slots(request, 1)`, in running order; then, with the budget the rows leave, the
    scheduler's own running pass (`_schedule_running`) over the tail, and its admission
    (`Admission.admit_waiting`: admitted requests join `running` after the tail); the step is
    counted (`count_step`) and the ids finished since the last step are handed over
    (returned, with the output of the tail and the admitted requests, if any: it lists only
    them).
  update (`update_step`): in running order, each row whose token fills a block is published
    (`register_computed_blocks`), and each row whose token leaves the decode fast path (its
    EOS, or the length cap) takes the stop rules (`_append_tokens`), which finish it (freed,
    removed from `running`); every other row's token is counted and its appending deferred.
    The caller then runs `update_from_output` on the output of the tail and the admitted
    requests (they follow the rows, as in the step's order) and `join`s, from the front of
    the tail, each that came out a plain decode, until one did not.
A row's computed tokens (and high-water mark) are caught up (`_sync_computed`) when it has an
event, its token list when it takes the stop rules or fills a block the block-key rule gives
no key for (the key stands for the tokens: `register_computed_blocks(row, ids)`), and both for
every row when the stretch ends (`leave`). Between steps, what others read of the
scheduler (requests, waiting queue, running membership and order, the KV pool, stats) is exactly
the per-step path's; a row's own counters lag until `leave`: nobody may read them before
(the passes over the tail and the waiting queue read only `len(running)` and, for the
partial-prefill cap, whether a running request owes more than one token: a lagging row never
does). `running` is always the alive rows, in order, then the tail.
`can_continue()` fails, and the caller must `leave()` and take the general path, when no row is
left, a slow-path token did not finish its request, a fork is fresh, or an allocation might
fail (and so preempt): the pool might not hold one block for every row on a boundary this step
plus the blocks the tail's chunks take.
"""

from __future__ import annotations

from itertools import compress
from typing import Callable, Optional, Protocol

from tokenweir.core.outputs import EngineCoreOutput, SchedulerOutput
from tokenweir.core.sched import stats as count
from tokenweir.core.sched.policies.base import SchedulingPolicy
from tokenweir.core.sched.policy import num_tokens_to_schedule
from tokenweir.core.sched.step_plan import StepPlan
from tokenweir.request import Request

# (request, computed, count) -> the output token ids sampled by `count` decode steps from
# `computed` computed tokens on (the runner's rule; none of them an EOS token id)
TokenRule = Callable[[Request, int, int], list[int]]
# (request, k) -> block k's ids as the KV manager keys them (kv_cache_manager.block_tokens_key)
# when the runner's rule alone gives every one of its tokens, else None
BlockKeyRule = Callable[[Request, int], object]


class TableBlockKeyRule(Protocol):
    """A BlockKeyRule that is also a table walk (the simulator's runner's: a row's block k
    is keyed by `table[(k * block_size + offset) % period]`, `make(start)` where that is None,
    for k >= first, where (first, offset) = `row(request)`; none before): the stretch reads
    it per row instead of calling the rule per filled block."""

    table: list
    period: int
    block_size: int  # the KV manager's

    def __call__(self, request: Request, k: int) -> object: ...
    def row(self, request: Request) -> tuple[int, int]: ...
    def make(self, start: int) -> object: ...
_HOOKS = ("begin_step", "on_scheduled", "victim_to_free", "end_step")


def policy_allows(policy: SchedulingPolicy) -> bool:
    """The policy's per-step hooks are the base class's no-ops (fcfs, priority)."""
    return all(getattr(type(policy), h) is getattr(SchedulingPolicy, h) for h in _HOOKS)


def eligible_rows(sched) -> list[Request]:
    """The leading running requests that may be a stretch's rows now (the entry conditions
    above; none when a condition on the scheduler fails). The caller checks `policy_allows`
    once."""
    running, config, kv = sched.running, sched.config, sched.kv
    if not running or config.prioritize_prefill or kv.has_lagging_registrations() \
            or kv.fresh_forks():
        return []
    n = 0
    for r in running[:config.max_num_batched_tokens]:
        if not is_plain_decode(r):
            break
        n += 1
    return running[:n]


def is_plain_decode(r: Request) -> bool:
    """A row's own entry condition: a decode (it owes one token and has sampled), a fast
    length cap, no parallel-sampling sample, nothing left to recompute."""
    computed = r.num_computed_tokens
    return (len(r.all_token_ids) - computed == 1 and r.fast_length_cap > 0
            and r.group is None
            and not (r.num_preemptions and r.max_computed_tokens > computed))


class DecodeStretch:
    """One scheduler's stretch state (see the module docstring); `num_steps` and
    `num_beside_steps` are probes."""

    def __init__(self, sched, tokens: TokenRule, eos_token_id: int,
                 block_key: Optional[BlockKeyRule] = None) -> None:
        self.sched, self._tokens, self._eos = sched, tokens, eos_token_id
        self._block_key = block_key
        self._table = block_key if hasattr(block_key, "row") else None  # TableBlockKeyRule
        assert self._table is None or self._table.block_size == sched.kv.block_size
        self.active = False
        self.num_steps = 0  # steps advanced in stretches (probe)
        self.num_beside_steps = 0  # of those, steps that scheduled more than the rows (probe)
        self.num_tail_steps = 0  # of those, steps with a tail (probe)
        self._clear()

    def _clear(self) -> None:
        # Per row, in running order (a finished row keeps its index, `_alive` False):
        self.rows: list[Optional[Request]] = []  # None once finished
        self._c0: list[int] = []  # computed tokens at step 0 (a row joining at step J: c - J)
        self._j0: list[int] = []  # the step it joined at (0: entry)
        self._at: list[int] = []  # steps applied to its computed tokens
        self._tok: list[int] = []  # steps whose tokens its token list holds
        self._alive: list[bool] = []
        self._eos_step: list[int] = []
        self._kfirst: list[int] = []  # with a table rule: its (first, offset) = row(request)
        self._koff: list[int] = []
        self._buckets: list[list[int]] = []  # residue -> alive rows on a boundary at j = it
        self._slow_at: dict[int, list[int]] = {}  # step -> rows leaving the fast path then
        self.j = 0  # steps completed
        self.n = 0  # rows alive (scheduled this step)
        self.context = 0  # sum of the alive rows' computed tokens before this step
        self._broken = False

    def enter(self, rows: list[Request], eos_steps: list[int]) -> None:
        """Start a stretch over `rows` (`eligible_rows`), row i sampling EOS at stretch step
        `eos_steps[i]`."""
        self._clear()
        self._buckets = [[] for _ in range(self.sched.kv.block_size)]
        self.active = True
        for r, eos_step in zip(rows, eos_steps):
            self._add_row(r, eos_step)

    def join(self, request: Request, left: int) -> None:
        """`request`, the tail's first (`running[n]`) after the step just updated, and a plain
        decode (`is_plain_decode`), becomes a row: it samples EOS after `left` more regular
        tokens (<= 0: at the next step)."""
        self._add_row(request, self.j + max(left, 0))

    def _add_row(self, r: Request, eos_step: int) -> None:
        """Row i = `r`, decoding from step `self.j` on, sampling EOS at step `eos_step`."""
        i, j, c = len(self.rows), self.j, r.num_computed_tokens
        self.rows.append(r)
        self._c0.append(c - j)
        self._j0.append(j)
        self._at.append(j)
        self._tok.append(j)
        self._alive.append(True)
        self._eos_step.append(eos_step)
        if self._table is not None:
            first, offset = self._table.row(r)
            self._kfirst.append(first)
            self._koff.append(offset)
        self._buckets[(j - c) % len(self._buckets)].append(i)  # on a boundary: c0 + j' = 0 mod bs
        cap_step = j + max(0, r.fast_length_cap - len(r.all_token_ids) - 1)
        self._slow_at.setdefault(min(eos_step, cap_step), []).append(i)
        self.n += 1
        self.context += c

    def can_continue(self) -> bool:
        sched = self.sched
        if self._broken or self.n == 0:
            return False
        free = sched.kv.num_free_blocks - len(self._buckets[self.j % len(self._buckets)])
        if len(sched.running) == self.n:
            return free >= 0
        return free >= 0 and not sched.kv.fresh_forks() and self._tail_blocks() <= free

    def _tail_blocks(self) -> int:
        """Blocks the scheduler's running pass over the tail will allocate this step: each
        tail request's for what it gets (a decode one token; a prefill its chunk, clamped by
        the threshold and by the budget the rows and the requests before it leave), in
        running order while budget is left."""
        sched = self.sched
        kv, threshold = sched.kv, sched.config.long_prefill_token_threshold
        budget, blocks = sched.config.max_num_batched_tokens - self.n, 0
        for r in sched.running[self.n:]:
            if budget <= 0:
                break
            computed = r.num_computed_tokens
            owed = len(r.all_token_ids) - computed
            q = 1 if owed == 1 else num_tokens_to_schedule(owed, budget, threshold)
            blocks += max(0, kv.blocks_for_tokens(computed + q) - kv.num_held_blocks(r.request_id))
            budget -= q
        return blocks

    def plan_step(self, now: float) -> tuple[set[str], Optional[SchedulerOutput]]:
        """Step j's plan at `now` (caller checked `can_continue`): returns the ids finished
        since the last step (for the runner to forget), and the output of the tail and the
        admitted requests (None: none scheduled), which lists only them, with those ids."""
        sched, j = self.sched, self.j
        allocate, rows, c0, at = sched.kv.allocate_slots, self.rows, self._c0, self._at
        for i in self._buckets[j % len(self._buckets)]:
            r = rows[i]  # its computed tokens are what allocate_slots reads
            if r.num_preemptions:
                self._sync_computed(i, j)
            else:  # _sync_computed(i, j) without the call: no high-water mark to keep
                r.num_computed_tokens = c0[i] + j
                at[i] = j
            assert allocate(r, 1) is not None, "can_continue checked the pool"
        plan = None
        # waiting or a tail: the scheduler's requests are exactly its running and waiting
        # ones (check_integrity), so this is `sched.waiting or len(sched.running) > self.n`
        # without the queue's two Python-level calls (__bool__, __len__) per step
        if len(sched.requests) > self.n:
            plan = StepPlan(sched.config.max_num_batched_tokens - self.n, now)
            self._schedule_tail(plan)
            sched.admission.admit_waiting(plan)
        tokens = sum(plan.num_scheduled.values()) if plan is not None else 0
        count.count_step(sched.stats, plan.num_chunked if tokens else 0, self.n + tokens)
        finished, sched._finished_since_last_step = sched._finished_since_last_step, set()
        self.num_steps += 1
        if not tokens:
            return finished, None
        self.num_beside_steps += 1
        return finished, plan.to_output(sched.kv, tokens, sched.stats.num_steps,
                                        sched.preemption.take_preempted_ids(), finished)

    def _schedule_tail(self, plan: StepPlan) -> None:
        """The scheduler's running pass over the tail alone (`running` rebound to it for the
        call, as the simulator's pipeline hides requests in flight): the rows before it took
        one token each, and `can_continue` checked that it allocates without preempting."""
        sched = self.sched
        running = sched.running
        if len(running) == self.n:
            return
        self.num_tail_steps += 1
        sched.running = running[self.n:]
        try:
            sched._schedule_running(plan, prefills=True, decodes=True)
        finally:
            sched.running = running

    def update_step(self, now: float) -> list[tuple[int, EngineCoreOutput]]:
        """Step j's update of the rows at `now`; returns (row, output) of each row that took
        the stop rules, in running order."""
        j, alive = self.j, self._alive
        bs = len(self._buckets)
        slow = self._slow_at.pop(j, None)
        filled = self._buckets[(j + 1) % bs] if self.sched.kv.enable_prefix_caching else ()
        n_before = self.n
        outputs = []
        if slow is None:  # only blocks filled (a bucket holds alive rows only)
            self._fill_blocks(filled, j)
        else:  # in running order: the runs of fills between the slow tokens, each as above
            run: list[int] = []
            for i in sorted(set(filled).union(slow)):
                if not alive[i]:
                    continue
                if i in slow:
                    if run:
                        self._fill_blocks(run, j)
                        run = []
                    outputs.append((i, self._slow_token(i, j, now)))
                else:  # a block filled: its tokens published
                    run.append(i)
            if run:
                self._fill_blocks(run, j)
        self.sched.stats.generation_tokens += n_before - (len(slow) if slow else 0)
        self.context += n_before
        self.j = j + 1
        return outputs

    def steps_in(self, i: int) -> int:
        """Stretch steps row i has decoded (through the last update)."""
        return self.j - self._j0[i]

    def _fill_blocks(self, filled: list[int], j: int) -> None:
        """`_fill_block(i, j)` for each row i in `filled`, in order (its body inlined for the
        rows never preempted: change them together)."""
        if self._table is None:
            for i in filled:
                self._fill_block(i, j)
            return
        rows, c0, at, kfirst, koff = self.rows, self._c0, self._at, self._kfirst, self._koff
        register, bs, c_next = self.sched.kv.register_computed_blocks, len(self._buckets), j + 1
        table, period, make = self._table.table, self._table.period, self._table.make
        for i in filled:
            r = rows[i]
            if r.num_preemptions:
                self._fill_block(i, j)
                continue
            c = r.num_computed_tokens = c0[i] + c_next
            at[i] = c_next
            k = c // bs - 1  # the rule's key of block k (TableBlockKeyRule), inlined
            if k >= kfirst[i]:
                start = (k * bs + koff[i]) % period
                ids = table[start] or make(start)
            else:
                ids = None
            if ids is None:
                self._sync_tokens(i, c_next)
            register(r, ids)

    def _fill_block(self, i: int, j: int) -> None:
        """Row i through step j's update, whose token fills a block, which is published: by
        the key the block-key rule gives (the token list keeps lagging), else from the token
        list caught up."""
        r = self.rows[i]
        if r.num_preemptions:
            self._sync_computed(i, j)
            count.count_recomputed_tokens(self.sched.stats, r, 1)
            c = r.num_computed_tokens = r.num_computed_tokens + 1
        else:  # _sync_computed(i, j) then one more, in one store (no high-water mark to keep)
            c = r.num_computed_tokens = self._c0[i] + j + 1
        self._at[i] = j + 1
        ids = self._block_key(r, c // len(self._buckets) - 1) if self._block_key else None
        if ids is None:
            self._sync_tokens(i, j + 1)
        self.sched.kv.register_computed_blocks(r, ids)

    def _slow_token(self, i: int, j: int, now: float) -> EngineCoreOutput:
        """Row i's step-j token through the stop rules (after the block it fills, if any, is
        published); a row they finish leaves the stretch."""
        r, sched = self.rows[i], self.sched
        self._sync_computed(i, j)
        self._sync_tokens(i, j)
        c = r.num_computed_tokens
        if r.num_preemptions:
            count.count_recomputed_tokens(sched.stats, r, 1)
        r.num_computed_tokens = c + 1
        self._at[i] = self._tok[i] = j + 1
        bs = len(self._buckets)
        if (c + 1) % bs == 0:
            sched.kv.register_computed_blocks(r)
        token = self._eos if j >= self._eos_step[i] else self._tokens(r, c, 1)[0]
        out = sched._append_tokens(r, [token], now)
        if out.finish_reason is None:
            self._broken = True  # not on the fast path any more: leave before the next step
        else:
            self._alive[i] = False
            self.rows[i] = None
            self._buckets[-self._c0[i] % bs].remove(i)
            self.n -= 1
            self.context -= c + 1
        return out

    def _sync_computed(self, i: int, k: int) -> None:
        """Row i's computed tokens (and high-water mark) as after k stretch steps."""
        if self._at[i] >= k:
            return
        r, computed = self.rows[i], self._c0[i] + k
        r.num_computed_tokens = computed
        if r.num_preemptions and r.max_computed_tokens < computed:
            r.max_computed_tokens = computed
        self._at[i] = k

    def _sync_tokens(self, i: int, k: int) -> None:
        """Row i's token list as after k stretch steps (the runner's rule)."""
        done = self._tok[i]
        if done >= k:
            return
        r = self.rows[i]
        r.all_token_ids.extend(self._tokens(r, self._c0[i] + done, k - done))
        self._tok[i] = k

    def leave(self) -> list[tuple[Request, int]]:
        """End the stretch: every row still running caught up; returns (row, `steps_in`) for
        each, in running order."""
        kept, j = [], self.j
        for i in compress(range(len(self.rows)), self._alive):
            self._sync_computed(i, j)
            self._sync_tokens(i, j)
            kept.append((self.rows[i], j - self._j0[i]))
        self.active = False
        self._clear()
        return kept
