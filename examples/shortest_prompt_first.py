"""A scheduling policy and a victim policy written outside tokenweir, run by name.

    ShortestPromptFirst   waiting requests in order of prompt length (shortest first, then
                          arrival): short prompts stop queueing behind long ones.
    MostWorkLeftVictim    when blocks run out, preempt the running request with the most
                          output tokens still to generate (it would hold its blocks longest).

Use them, unchanged, in the real engine and in the simulator (repository root on PYTHONPATH):

    tokenweir simulate --scheduling-policy examples.shortest_prompt_first:ShortestPromptFirst \
                       --preemption-policy examples.shortest_prompt_first:MostWorkLeftVictim
    LLM(model, scheduling_policy="examples.shortest_prompt_first:ShortestPromptFirst")

    python examples/shortest_prompt_first.py   # the simulator, fcfs vs this policy

The interface is tokenweir/core/sched/policies/base.py; this policy overrides only the waiting
queue, the victim policy only `choose`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tokenweir.core.sched.policies import SchedulingPolicy, VictimPolicy
from tokenweir.core.sched.queues import KeyedQueue
from tokenweir.request import Request


class ShortestPromptQueue(KeyedQueue):
    """Fewest prompt tokens first, then earliest arrival. A preempted request keeps its key,
    so it comes back ahead of every longer prompt."""

    def key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_time)


class ShortestPromptFirst(SchedulingPolicy):
    name = "shortest-prompt-first"

    def make_waiting_queue(self) -> KeyedQueue:
        return ShortestPromptQueue()


class MostWorkLeftVictim(VictimPolicy):
    name = "most-work-left"

    def choose(self, running: Sequence[Request], requester: Request,
               cost_of: Callable[[Request], float]) -> Request:
        return max(running, key=lambda r: (r.max_tokens - r.num_output_tokens, r.arrival_time))


def _demo() -> None:
    """The same workload in the simulator under fcfs and under this policy."""
    from tokenweir.sim.build import build_simulation
    from tokenweir.sim.metrics import summarize
    from tokenweir.sim.workload import RequestSpec

    specs = [RequestSpec(f"r{i}", arrival=0.0, prompt_len=3000 if i % 4 == 0 else 200,
                         output_len=400, index=i) for i in range(32)]
    here = "examples.shortest_prompt_first"
    for label, kwargs in (("fcfs", {}),
                          ("shortest-prompt-first", {
                              "scheduling_policy": f"{here}:ShortestPromptFirst",
                              "preemption_policy": f"{here}:MostWorkLeftVictim"})):
        sim = build_simulation(dict(max_num_seqs=4, max_num_batched_tokens=2048,
                                    num_gpu_blocks_override=300, scheduler_reserve_full_isl=False,
                                    **kwargs), specs)
        summary = summarize(sim.run())
        print(f"{label:>22}: {type(sim.scheduler.policy).__name__} + "
              f"{type(sim.scheduler.victim_policy).__name__}: "
              f"mean TTFT {summary['ttft_mean_ms']:7.1f} ms, "
              f"p50 TTFT {summary['ttft_p50_ms']:7.1f} ms, "
              f"{summary['preemptions']} preemptions")


if __name__ == "__main__":
    _demo()
