"""Latency models: how long one step takes on the virtual clock.

Interface (`LatencyModel`): `predict(scheduler_output, context_lens) -> seconds`, where
`context_lens[req_id]` is the number of tokens whose KV the request already has in the cache
before this step (its `num_computed_tokens` as the runner tracks it). Every request in
`scheduler_output.num_scheduled_tokens` must have an entry. Models are pure functions of their
arguments: the simulator's determinism rests on it.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol

from tokenweir.core.outputs import SchedulerOutput
from tokenweir.sim.hardware import HardwareProfile, ModelShape


class LatencyModel(Protocol):
    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float: ...


class RooflineLatencyModel:
    """Analytic roofline of one forward step, split tensor-parallel over `tp` devices.

    step = overhead
         + max(linear FLOPs / FLOP/s, weight bytes / bandwidth)          (GEMMs and LM head)
         + max(attention FLOPs / FLOP/s, KV bytes read+written / bandwidth)
         + 2 ring all-reduces per layer of the step's activations (tp > 1 only).
    Attention FLOPs are causal: a chunk of q new tokens on c cached ones costs
    4 * heads * head_dim * q * (c + (q + 1) / 2) per layer. The LM head runs once per scheduled
    request (logits only at each request's last position).
    """

    def __init__(self, shape: ModelShape, hardware: HardwareProfile, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
        self.shape, self.hardware, self.tp = shape, hardware, tp
        dt = hardware.dtype_bytes
        flops = hardware.effective_flops * tp
        bw = hardware.effective_bandwidth * tp
        # Per-unit costs, precomputed: the hot path is a few multiply-adds per step.
        self._s_per_token_linear = 2 * shape.num_layers * shape.params_per_layer / flops
        self._s_per_lm_head_row = 2 * shape.vocab_size * shape.hidden_size / flops
        self._s_weights = shape.num_matmul_params * dt / bw
        # Attention: 4*H*hd*L * q*(c + (q+1)/2) = 2*H*hd*L * q*(2c + q + 1)
        self._s_per_attn_unit = 2 * shape.num_heads * shape.head_dim * shape.num_layers / flops
        self._s_per_kv_token = shape.kv_bytes_per_token(dt) / bw
        self._overhead = hardware.step_overhead_s
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            calls = 2 * shape.num_layers
            self._s_allreduce_per_token = (calls * ring * shape.hidden_size * dt
                                           / hardware.interconnect_bandwidth)
            self._s_allreduce_fixed = calls * hardware.allreduce_latency_s
        else:
            self._s_allreduce_per_token = self._s_allreduce_fixed = 0.0

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing `(num_new_tokens, num_cached_tokens)` per request."""
        tokens = rows = attn_units = kv_tokens = 0
        for q, c in chunks:
            tokens += q
            rows += 1
            attn_units += q * (2 * c + q + 1)
            kv_tokens += c + 2 * q  # read the context and the new tokens, write the new ones
        return self._combine(tokens, rows, attn_units, kv_tokens)

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        tokens = rows = attn_units = kv_tokens = 0
        for rid, q in scheduler_output.num_scheduled_tokens.items():
            c = context_lens[rid]
            tokens += q
            rows += 1
            attn_units += q * (2 * c + q + 1)
            kv_tokens += c + 2 * q
        return self._combine(tokens, rows, attn_units, kv_tokens)

    def _combine(self, tokens: int, rows: int, attn_units: int, kv_tokens: int) -> float:
        if tokens == 0:
            return 0.0
        linear = max(tokens * self._s_per_token_linear + rows * self._s_per_lm_head_row,
                     self._s_weights)
        attention = max(attn_units * self._s_per_attn_unit, kv_tokens * self._s_per_kv_token)
        comm = tokens * self._s_allreduce_per_token + self._s_allreduce_fixed
        return self._overhead + linear + attention + comm


class ConstantLatencyModel:
    """Every non-empty step takes `seconds` (tests, and back-of-envelope runs)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, scheduler_output: SchedulerOutput,
                context_lens: Mapping[str, int]) -> float:
        return self.seconds if scheduler_output.total_num_scheduled_tokens else 0.0
