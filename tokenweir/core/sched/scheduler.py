"""The token-budget scheduler (vLLM v1 semantics): orchestration, read top to bottom.

There is no prefill phase and no decode phase. Each step hands out `max_num_batched_tokens`:
running requests first (in the order the policy keeps them), then waiting ones (admission.py).
A request asks for what it still owes (`num_tokens - num_computed_tokens`), clamped by
`long_prefill_token_threshold` and by the budget left; chunked prefill is what the budget does
to a long prompt. When `allocate_slots` returns None the scheduler sheds load: the victim
policy names a victim and preemption.py applies recompute or swap; a step that preempted for
memory admits nobody new. The scheduling policy (policies/) orders the queues and may pause,
veto or free; this file never asks which policy it holds. Stop rules: stop.py; counting:
stats.py; parallel-sampling groups: forks.py; a request whose update raises: failure.py; the
boundary objects: core/outputs.py. No torch, no clocks: `now` comes from the scheduler's driver.
"""
from __future__ import annotations

from typing import Iterable, Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.outputs import (SLO_BETWEEN_STEPS, SLO_MID_STEP, EngineCoreOutput,
                                    ModelRunnerOutput, SchedulerOutput, SchedulerStats)
from tokenweir.core.sched import admission, stats as count
from tokenweir.core.sched.failure import fail_in_update
from tokenweir.core.sched.forks import Forks
from tokenweir.core.sched.integrity import check_integrity
from tokenweir.core.sched.policies import Pause, SchedulingPolicy, VictimPolicy, make_policies
from tokenweir.core.sched.policy import PreemptionCosts, num_tokens_to_schedule
from tokenweir.core.sched.preemption import Preemption
from tokenweir.core.sched.step_plan import StepPlan, scheduled_pairs
from tokenweir.core.sched.stop import fast_length_cap, stop_status
from tokenweir.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, costs: Optional[PreemptionCosts] = None,
                 policy: Optional[SchedulingPolicy] = None,
                 victim_policy: Optional[VictimPolicy] = None) -> None:
        """`policy` / `victim_policy`: objects to use; by default those the config names."""
        config.validate()
        self.config, self.kv, self.max_model_len = config, kv_cache_manager, max_model_len
        admission.check_pool_fits_one_sequence(self.kv, max_model_len)
        admission.check_budget_fits_one_sequence(config, max_model_len)
        self.costs = costs = costs or PreemptionCosts()  # the engine may set measured ones
        if policy is None or victim_policy is None:
            default_policy, default_victim = make_policies(config, costs)
            policy, victim_policy = policy or default_policy, victim_policy or default_victim
        self.policy, self.victim_policy = policy, victim_policy
        self.waiting = policy.make_waiting_queue()
        # In the order the running pass serves them. `running` and `config` may be rebound
        # (the simulator hides a pipeline's in-flight requests around one schedule()).
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self.stats = SchedulerStats()
        self.admission, self.preemption = admission.Admission(self), Preemption(self)
        self.forks, self.watermark_blocks = Forks(self), self.admission.watermark_blocks

    # ---- requests in and out -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.max_num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id}: prompt + max_tokens = "
                             f"{request.max_num_tokens} exceeds max_model_len={self.max_model_len}")
        self.forks.add(request)  # parallel sampling: a group's parent (forks.py)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        request.fast_length_cap = fast_length_cap(request)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (abort) requests wherever they are; unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
        self.forks.finished(request, status, self._finished_since_last_step)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # ---- schedule ----------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan one step. `now` (the caller's clock) stamps first_scheduled_time and reaches
        the policy."""
        plan = StepPlan(token_budget=self.config.max_num_batched_tokens, now=now)
        pause = self.policy.begin_step(self, plan)
        if pause is not None:
            self._pause(pause, plan)
        if self.config.prioritize_prefill:
            self._schedule_running(plan, prefills=True, decodes=False)
            self.admission.admit_waiting(plan)
            self._schedule_running(plan, prefills=False, decodes=True)
        else:
            self._schedule_running(plan, prefills=True, decodes=True)
            self.admission.admit_waiting(plan)
        victim = self.policy.victim_to_free(self, plan)
        if victim is not None:
            self.preemption.preempt(victim, plan, SLO_BETWEEN_STEPS, count_cause=False)
            self.admission.admit_waiting(plan)
        output = self._make_output(plan)
        self.policy.end_step(self, output, now)
        return output

    def _pause(self, pause: Pause, plan: StepPlan) -> None:
        victim = self.requests[pause.victim_id]
        victim.num_slo_preemptions += 1
        victim.num_slo_pauses += 1
        self.stats.preemptions_by_cause[SLO_BETWEEN_STEPS] += 1
        plan.paused.add(pause.victim_id)

    def _schedule_running(self, plan: StepPlan, prefills: bool, decodes: bool) -> None:
        """Give running requests their next tokens; preempt victims when the pool is full."""
        i, running = 0, self.running  # `running` is mutated in place only (remove, sort)
        scheduled, paused = plan.num_scheduled, plan.paused
        check_scheduled = bool(scheduled)  # a second pass (prioritize_prefill) meets the first's
        allocate, block_size = self.kv.allocate_slots, self.kv.block_size
        fresh_forks = self.kv.fresh_forks()  # parallel sampling: new to the runner, may copy
        cached_req_ids, cached_num_computed = plan.cached_req_ids, plan.cached_num_computed
        scheduled_reqs = plan.scheduled
        # Hot: a decode whose computed tokens end inside a block with room for its next one.
        # `plain`: no set excludes a decode this pass; runs of hot ones go in add_hot_decodes.
        plain = decodes and not (check_scheduled or paused or fresh_forks)
        while i < len(running) and plan.token_budget > 0:
            if plain:
                i = plan.add_hot_decodes(running, i, block_size)
                if i >= len(running) or plan.token_budget <= 0:
                    break
            request = running[i]
            computed = request.num_computed_tokens
            owed = len(request.all_token_ids) - computed
            rid = request.request_id
            if not (prefills if owed > 1 else decodes) \
                    or (check_scheduled and rid in scheduled) or (paused and rid in paused) \
                    or (owed > 1 and plan.prefills_closed):
                i += 1  # owed > 1: policy.is_prefilling
                continue
            if owed == 1 and computed % block_size and not (fresh_forks and rid in fresh_forks):
                # plan.add, inlined: no chunk, no preemption, no new blocks (none listed)
                scheduled[rid] = 1
                scheduled_reqs.append(request)
                cached_req_ids.append(rid)
                cached_num_computed.append(computed)
                plan.token_budget -= 1
                i += 1
                continue
            fresh = rid in fresh_forks
            num_tokens = 1 if owed == 1 else num_tokens_to_schedule(
                owed, plan.token_budget, self.config.long_prefill_token_threshold)
            assert num_tokens > 0, f"running request {rid} owes no tokens"
            block_ids = None if fresh else allocate(request, num_tokens)
            if block_ids is None:
                block_ids = self.preemption.allocate_or_preempt(request, num_tokens, plan, fresh)
                if block_ids is None:
                    break  # the request itself was preempted: nothing later can be cheaper
            if plan.preempted:
                # A victim ahead of `request` in `running` (priority policy) shifted it left.
                while i >= len(running) or running[i] is not request:
                    i -= 1
            plan.add(request, num_tokens, block_ids, is_new=fresh)
            if owed > 1:
                self.policy.on_scheduled(self, request, plan)
            i += 1

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        total = sum(plan.num_scheduled.values())
        assert total <= self.config.max_num_batched_tokens
        count.count_step(self.stats, plan.num_chunked, total)
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return plan.to_output(self.kv, total, self.stats.num_steps,
                              self.preemption.take_preempted_ids(), finished)

    # ---- update ------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput, now: float = 0.0,
                           decoded: Optional[list[str]] = None) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, apply stop rules, free the finished.

        Requests aborted or preempted since `scheduler_output` was made are skipped.
        Fault isolation: a request whose update raises fails alone (failure.fail_in_update);
        the other requests of the step are updated as usual.
        `decoded` (the bulk path of the simulator and offline steps; not with logprobs): when
        given, a request that got one token, neither its first nor its last, is listed there by
        id (its token in `all_token_ids`) instead of an output, unless `needs_token_outputs`.
        """
        # The per-token path of engine and simulator: locals, calls only where needed.
        outputs: list[EngineCoreOutput] = []
        requests, running = self.requests, RequestStatus.RUNNING
        sampled, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        kv, num_fast = self.kv, 0
        register = kv.register_computed_blocks if kv.enable_prefix_caching else None
        # Publishing has work only where a step filled a block, unless some lag (swap-outs).
        block_size, lagging = kv.block_size, kv.has_lagging_registrations()
        bulk = decoded.append if decoded is not None and not logprobs else None
        for request, num_tokens in scheduled_pairs(scheduler_output, requests):
            if request.status is not running:  # statuses are the members
                continue
            request_id = request.request_id
            try:  # the per-request guard: free (zero-cost) unless it raises
                computed = request.num_computed_tokens + num_tokens
                if request.num_preemptions:  # the recompute tax; the mark (else preemption.py's)
                    count.count_recomputed_tokens(self.stats, request, num_tokens)
                request.num_computed_tokens = computed
                if register is not None and (lagging or computed % block_size < num_tokens):
                    register(request)
                new_token_ids = sampled.get(request_id)
                if not new_token_ids:
                    continue
                # Decode fast path: one token, not the first, that no stop rule can end: below
                # the length cap (0 before the first token, and with stop token ids: stop.py),
                # not an EOS token id. Everything else takes _append_tokens and stop_status.
                token_id = new_token_ids[0]
                all_token_ids = request.all_token_ids
                if (len(all_token_ids) + 1 < request.fast_length_cap and len(new_token_ids) == 1
                        and token_id not in request.eos_token_ids):
                    all_token_ids.append(token_id)
                    num_fast += 1
                    if bulk is not None and not request.needs_token_outputs:
                        bulk(request_id)
                        continue
                    output = EngineCoreOutput(request, [token_id])
                else:
                    output = self._append_tokens(request, new_token_ids, now)
                if logprobs:
                    output.logprobs = logprobs.get(request_id)
                outputs.append(output)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                outputs.append(fail_in_update(self, request, exc, now))
        self.stats.generation_tokens += num_fast
        return outputs

    def _append_tokens(self, request: Request, token_ids: list[int],
                       now: float) -> EngineCoreOutput:
        if request.first_token_time is None:
            request.first_token_time = now
            request.fast_length_cap = fast_length_cap(request)
            count.count_first_token(self.stats, request, now)
            self.forks.first_token(request, now)  # before a stop rule can free its blocks
        appended: list[int] = []
        status: Optional[RequestStatus] = None
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            status = stop_status(request, token_id, self.max_model_len)
            if status is not None:
                break
        self.stats.generation_tokens += len(appended)
        output = EngineCoreOutput(request=request, new_token_ids=appended)
        if status is not None:
            self.running.remove(request)
            request.finished_time = now
            self._finish(request, status)
            output.finish_reason = status.finish_reason
        return output

    def roll_back_cut_step(self, scheduler_output: SchedulerOutput, victim_id: Optional[str],
                           layers_run: int, num_layers: int,
                           waiter_id: Optional[str] = None) -> None:
        """The step was cut at a layer boundary: call this INSTEAD of update_from_output.

        As if the step never ran: no request's num_computed_tokens advances, nothing is
        sampled, the K/V the step wrote lies past every request's computed tokens (it is never
        read, and is overwritten when those positions are computed again; it was never
        published to the prefix cache). Requests keep the blocks the step gave them. The
        victim is preempted (blocks freed, re-queued); the waiter is admitted next step.
        Step ids are not reused, so a stale cut order can never match a later step.
        """
        count.count_cut_step(self.stats, scheduler_output, layers_run, num_layers,
                             self.requests)
        victim = self.requests.get(victim_id) if victim_id is not None else None
        if victim is not None and victim.status == RequestStatus.RUNNING:
            victim.num_slo_preemptions += 1
            self.preemption.preempt(victim, StepPlan(token_budget=0), SLO_MID_STEP)
            self.policy.on_cut(victim.request_id, waiter_id)

    def check_integrity(self) -> None:
        """Invariants that hold between steps (integrity.py); tests call it after every step."""
        check_integrity(self)
