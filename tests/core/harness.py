"""A scripted stand-in for the model runner: no torch, deterministic tokens.

`FakeRunner.execute` mirrors the real runner's contract (core/outputs.py): it tracks each
request's known tokens and samples exactly when a step reaches the end of them. The sampled
token is a pure function of (request id, position), so any schedule of the same requests must
produce the same tokens: the identity that cramped-vs-roomy tests check.
"""

from __future__ import annotations

import zlib

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.scheduler import Scheduler
from tokenweir.request import Request, SamplingParams

EOS = 2


def token_at(request_id: str, position: int, vocab: int = 1000) -> int:
    return 3 + zlib.crc32(f"{request_id}:{position}".encode()) % (vocab - 3)


class FakeRunner:
    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.known: dict[str, int] = {}  # request id -> tokens the runner knows
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        # request id -> output index that samples EOS; the caller may keep adding to its dict
        self.eos_at = eos_at if eos_at is not None else {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.known.pop(rid, None)
            self.computed.pop(rid, None)
            self.blocks.pop(rid, None)
            self.prompt_len.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.known[new.req_id] = len(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.blocks[new.req_id] = list(new.block_ids)
            self.prompt_len[new.req_id] = new.num_prompt_tokens
        for cached in out.scheduled_cached_reqs:
            assert self.computed[cached.req_id] == cached.num_computed_tokens
            self.blocks[cached.req_id].extend(cached.new_block_ids)
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n
            assert self.computed[rid] <= self.known[rid]
            if self.computed[rid] == self.known[rid]:
                sampled[rid] = [self._next_token(rid)]
                self.known[rid] += 1
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _next_token(self, rid: str) -> int:
        output_index = self.known[rid] - self.prompt_len[rid]
        if self.eos_at.get(rid) == output_index:
            return EOS
        return token_at(rid, self.known[rid])


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
                 priority: int = 0, ignore_eos: bool = False, **params_kw) -> Request:
    """`params_kw` go to SamplingParams (min_tokens, stop_token_ids, ...)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            **params_kw)
    prompt = [token_at(rid + "-p", i) for i in range(prompt_len)]
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                   max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                   eos_token_ids=frozenset({EOS}))


def make_scheduler(num_blocks: int = 1000, block_size: int = 16, max_model_len: int = 4096,
                   enable_prefix_caching: bool = False, num_host_blocks: int = 0,
                   costs=None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                        num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**config), kv, max_model_len, costs=costs)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 100_000,
                      check: bool = True) -> dict[str, list[int]]:
    """Step until idle; returns every finished request's output tokens."""
    finished: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        for eco in scheduler.update_from_output(out, runner.execute(out)):
            if eco.finish_reason is not None:
                finished[eco.request.request_id] = eco.request.output_token_ids
        if check:
            scheduler.check_integrity()
    raise AssertionError("scheduler did not finish")


def step(scheduler: Scheduler, runner: FakeRunner, now: float = 0.0):
    """One engine step: schedule, execute, update. Returns (SchedulerOutput, EngineCoreOutputs)."""
    out = scheduler.schedule(now)
    return out, scheduler.update_from_output(out, runner.execute(out), now)


def expected_output(request: Request, eos_at: int | None = None) -> list[int]:
    """The tokens FakeRunner must produce for `request` if it runs to completion under any
    schedule: token_at per position, EOS at output index `eos_at`, capped by max_tokens."""
    tokens: list[int] = []
    for k in range(request.max_tokens):
        if eos_at == k:
            tokens.append(EOS)
            break
        tokens.append(token_at(request.request_id, request.num_prompt_tokens + k))
    return tokens


def make_prompt_request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0,
                        priority: int = 0, **params_kw) -> Request:
    """Like make_request, with explicit prompt token ids (for shared prefixes)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **params_kw)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params,
                   max_tokens=max_tokens, arrival_time=arrival, priority=priority,
                   eos_token_ids=frozenset({EOS}))


def kv_chain(token_ids: list[int], start: list[int] | None = None) -> list[int]:
    """The 'KV' of each position: a hash of the whole token history up to it, so equal KV means
    an equal prefix. `start` is an existing chain to extend."""
    chain = list(start or [])
    h = chain[-1] if chain else 0
    for t in token_ids[len(chain):]:
        h = hash((h, t))
        chain.append(h)
    return chain


class KVContentRunner(FakeRunner):
    """FakeRunner that also models the KV bytes in device and host blocks.

    Before the forward it copies swap-ins, then swap-outs, reading copy-on-write sources
    before both and writing their destinations after (the outputs.py contract). Then, for
    every scheduled request, it checks that each position below `num_computed_tokens` holds that
    request's KV in its block table (prefix hits, swapped-in blocks, its own earlier steps), and
    writes the KV of the positions computed this step, asserting each written block is held by
    this request alone (ref count 1) and is not published in the prefix cache.
    """

    def __init__(self, pool, block_size: int, eos_at: dict[str, int] | None = None) -> None:
        super().__init__(eos_at)
        self.pool = pool  # the scheduler's BlockPool (kv.pool)
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.chain: dict[str, list[int]] = {}  # request id -> KV of every known position
        self.tokens: dict[str, list[int]] = {}
        self.context_checks = 0  # positions verified (a probe that checking happened)
        self.writes = 0
        self.copies = 0  # copy-on-write block copies made

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        garbage = [None] * self.bs  # a block never written (its copy is garbage too)
        # copy-on-write sources are read before the swaps, destinations written after them
        pending = [list(self.device.get(s, garbage)) for s, _ in out.blocks_to_copy]
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host.get(h, garbage))
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device.get(d, garbage))
        for (_, d), content in zip(out.blocks_to_copy, pending):
            self.device[d] = content
        self.copies += len(out.blocks_to_copy)
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.chain.pop(rid, None)
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.chain[new.req_id] = kv_chain(new.token_ids)
        result = super().execute(out)
        spans = {rid: (self.computed[rid] - n, self.computed[rid])
                 for rid, n in out.num_scheduled_tokens.items()}
        for rid, (start, _) in spans.items():  # every read happens before any write
            self._check_context(rid, start)
        for rid, (start, end) in spans.items():
            self._write(rid, start, end)
        for rid, toks in result.sampled_token_ids.items():
            self.tokens[rid].extend(toks)
            self.chain[rid] = kv_chain(self.tokens[rid], self.chain[rid])
        return result

    def _check_context(self, rid: str, num_computed: int) -> None:
        bs, table, chain = self.bs, self.blocks[rid], self.chain[rid]
        for k in range(-(-num_computed // bs)):
            lo, hi = k * bs, min((k + 1) * bs, num_computed)
            got = self.device.get(table[k], [])[:hi - lo]
            assert got == chain[lo:hi], (
                f"{rid}: block {table[k]} (index {k}) does not hold its KV for positions "
                f"{lo}..{hi - 1}")
        self.context_checks += num_computed

    def _write(self, rid: str, start: int, end: int) -> None:
        bs, table, chain = self.bs, self.blocks[rid], self.chain[rid]
        for p in range(start, end):
            block_id = table[p // bs]
            block = self.pool.blocks[block_id]
            assert block_id != 0 and block.ref_cnt == 1 and block.key is None, (
                f"{rid} writes position {p} into {block} (key {block.key}): shared or published")
            self.device.setdefault(block_id, [None] * bs)[p % bs] = chain[p]
        self.writes += end - start


def device_tables(scheduler: Scheduler) -> dict[str, list[int]]:
    """Every request's device block ids (take it before schedule(): the content is live)."""
    return {rid: [b.block_id for b in blocks]
            for rid, blocks in scheduler.kv.req_to_blocks.items()}


def check_swap_order(out: SchedulerOutput, scheduler: Scheduler,
                     tables_before: dict[str, list[int]],
                     scheduled_tables: dict[str, list[int]]) -> dict:
    """The copy-order contract of one step: swap-ins (host -> device), then swap-outs
    (device -> host), then the forward. Returns what overlapped, for probes.

    `tables_before`: `device_tables` taken before this step was scheduled.
    `scheduled_tables`: every request scheduled this step -> its whole block table.
    Safe: a swap-out source handed to another request this step (the copy reads it before the
    forward writes it); a request swapped in and straight out again (its blocks get the
    swapped-in bytes, then copy them back). Broken: a swap-in overwriting a block whose live
    content a victim swapped out in the same step still has to copy; any block written twice
    by copies. (A device block may be read twice: a prefix block shared by two victims.)
    """
    in_dev = [d for _, d in out.blocks_to_swap_in]
    out_dev = [d for d, _ in out.blocks_to_swap_out]
    out_host = [h for _, h in out.blocks_to_swap_out]
    assert len(set(in_dev)) == len(in_dev), "two swap-ins write one device block"
    assert len(set(out_host)) == len(out_host), "two swap-outs write one host block"
    # A swapped victim keeps (and still holds) its leading blocks shared with others.
    live = {b for rid in out.preempted_req_ids if scheduler.kv.is_swapped(rid)
            for b in tables_before.get(rid, ()) if b not in scheduler.kv.block_ids(rid)}
    assert live <= set(out_dev), "a swapped-out victim's block is not copied"
    clobbered = set(in_dev) & live
    assert not clobbered, f"swap-ins overwrite {clobbered} before their swap-outs read them"
    held_now = {b for table in scheduled_tables.values() for b in table}
    return {"swap_out_reused": set(out_dev) & held_now, "in_and_out": set(in_dev) & set(out_dev)}
