"""The simulator's model runner: no model, no torch; tokens by rule, time by a latency model.

`SimRunner.execute(scheduler_output)` honours the runner contract of core/outputs.py exactly as
the real runner does: new requests arrive in full (re-admitted ones too), cached ones as diffs,
and finished or preempted ids are forgotten. A request samples a token exactly when a step
brings its computed tokens up to the tokens the runner knows for it. The sampled token is EOS
when that output reaches the request's target length (`target_output_len`), otherwise a
deterministic non-EOS id. The step's duration comes from the latency model, given each
request's cached context before the step.
"""

from __future__ import annotations

from typing import Mapping, Optional

from tokenweir.core.outputs import CutReport, ModelRunnerOutput, SchedulerOutput

DEFAULT_EOS = 2
_FIRST_REGULAR_TOKEN = 3


class SimRunner:
    def __init__(self, latency_model, target_output_len: Optional[Mapping[str, int]] = None,
                 eos_token_id: int = DEFAULT_EOS, vocab_size: int = 32000,
                 check: bool = False) -> None:
        self.latency_model = latency_model
        # request id -> output length at which EOS is sampled; the caller may add to it later
        self.target_output_len = target_output_len if target_output_len is not None else {}
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.check = check  # assert the contract (tests); off on the hot path
        self.known: dict[str, int] = {}  # tokens the runner knows (prompt + outputs so far)
        self.computed: dict[str, int] = {}  # tokens whose KV the runner has written
        self.num_prompt: dict[str, int] = {}
        self.num_blocks: dict[str, int] = {}
        # Mid-step cuts (slo policy): keep what the last step advanced, so `cut` can undo it.
        self.keep_undo = False
        self._undo: dict[str, tuple[int, int]] = {}

    @property
    def num_tracked(self) -> int:
        return len(self.known)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._forget(out.finished_req_ids)
        self._forget(out.preempted_req_ids)
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            self.known[rid] = len(new.token_ids)
            self.computed[rid] = new.num_computed_tokens
            self.num_prompt[rid] = new.num_prompt_tokens
            self.num_blocks[rid] = len(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            rid = cached.req_id
            if self.check:
                assert self.computed[rid] == cached.num_computed_tokens, (
                    f"{rid}: runner has {self.computed[rid]} computed, scheduler says "
                    f"{cached.num_computed_tokens}")
            self.num_blocks[rid] += len(cached.new_block_ids)
        seconds = self.latency_model.predict(out, self.computed) if out.num_scheduled_tokens \
            else 0.0
        if self.keep_undo:
            self._undo = {rid: (self.computed[rid], self.known[rid])
                          for rid in out.num_scheduled_tokens}
        return ModelRunnerOutput(sampled_token_ids=self._advance(out), step_seconds=seconds)

    def cut(self, out: SchedulerOutput, step_seconds: float, layer_index: int, num_layers: int,
            victim_id: str, waiter_id: Optional[str] = None) -> ModelRunnerOutput:
        """The last executed step (`out`, predicted to take `step_seconds`) is cut before layer
        `layer_index`: undo its advance and samples, as the real runner never makes them, and
        report the cut. The step lasted layer_index / num_layers of its time."""
        for rid, (computed, known) in self._undo.items():
            self.computed[rid], self.known[rid] = computed, known
        self._undo = {}
        return ModelRunnerOutput(
            sampled_token_ids={}, step_seconds=step_seconds * layer_index / num_layers,
            cut=CutReport(out.step_id, layer_index, num_layers, victim_id, waiter_id))

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            if self.known.pop(rid, None) is not None:
                del self.computed[rid], self.num_prompt[rid], self.num_blocks[rid]

    def _advance(self, out: SchedulerOutput) -> dict[str, list[int]]:
        known, computed = self.known, self.computed
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            done = computed[rid] + n
            computed[rid] = done
            k = known[rid]
            if done == k:
                sampled[rid] = [self._token(rid, k)]
                known[rid] = k + 1
            elif self.check:
                assert done < k, f"{rid}: computed {done} past the {k} known tokens"
        return sampled

    def _token(self, rid: str, position: int) -> int:
        """The token at `position` (0-based over prompt + output)."""
        output_index = position - self.num_prompt[rid]
        target = self.target_output_len.get(rid)
        if target is not None and output_index + 1 >= target:
            return self.eos_token_id
        span = self.vocab_size - _FIRST_REGULAR_TOKEN
        return _FIRST_REGULAR_TOKEN + (position * 7919 + len(rid)) % span
