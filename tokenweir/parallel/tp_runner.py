"""One rank's model runner under tensor parallelism.

Every rank runs the SAME `ModelRunner` step on the same `SchedulerOutput`: identical request
state, identical flattened batch, its own shard of the weights and its own KV heads. Only two
things differ from the single-process runner:

* sampling: rank 0 samples and broadcasts the sampled token ids (one int64 per sampled row;
  every rank knows how many from its own batch), so every rank appends the same tokens;
* cutting: a rank never obeys a cut signal on its own. When the step holds a vote
  (`execute_step(out, should_cut)`), the forward runs with the collective vote hook
  (tokenweir.parallel.vote) instead; the base runner turns the resulting StepCut into
  `ModelRunnerOutput.cut` on every rank alike, with the per-request copies standing as before
  the forward (runner/interrupt.py's contract, which the scheduler's rollback assumes).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenweir.parallel.vote import ShouldCut, make_vote_hook
from tokenweir.runner.model_runner import ModelRunner


class TPModelRunner(ModelRunner):
    def __init__(self, *args, rank: int, group: Optional[dist.ProcessGroup] = None,
                 **kwargs) -> None:
        """ModelRunner's arguments with this rank's shard model and per-rank arch."""
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.group = group
        self._vote: Optional[ShouldCut] = None  # this step's local vote; None: no vote held
        self._step_id = 0

    def execute_step(self, out: SchedulerOutput,
                     should_cut: Optional[ShouldCut] = None) -> ModelRunnerOutput:
        """Run one step; with `should_cut`, hold the cut vote at every layer boundary. Every
        rank must call this with the same `out`, and with `should_cut` None on all or on none."""
        self._vote, self._step_id = should_cut, out.step_id
        try:
            return self.execute(out)
        finally:
            self._vote = None

    def _forward(self, batch, layer_hook=None) -> torch.Tensor:
        """Ignores the single-process hook: a lone rank leaving the forward would strand the
        others in their next all-reduce. Only the collective vote may cut."""
        hook = None
        if self._vote is not None:
            hook = make_vote_hook(self._vote, self._step_id, self.device, self.group)
        return super()._forward(batch, hook)

    def _sample(self, batch, hidden: torch.Tensor, step_id: int):
        """Rank 0 draws; every rank returns the same token ids."""
        if not batch.sample_req_ids:
            return {}, {}
        if self.rank == 0:
            sampled, logprobs = super()._sample(batch, hidden, step_id)
            ids = torch.tensor([sampled[r] for r in batch.sample_req_ids], dtype=torch.long,
                               device=self.device)
        else:
            logprobs = {}
            ids = torch.empty(len(batch.sample_req_ids), dtype=torch.long, device=self.device)
        dist.broadcast(ids, src=0, group=self.group)
        return dict(zip(batch.sample_req_ids, ids.tolist())), logprobs
