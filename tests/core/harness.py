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
