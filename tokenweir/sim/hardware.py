"""Model shapes and hardware profiles the analytic latency model reads.

GPU figures are published dense bf16 peaks and HBM bandwidths (vendor data sheets, SXM parts);
the efficiency factors turn peaks into what kernels reach. The CPU profile is APPROXIMATE: a
rough figure for this machine kind (AVX2 EPYC, 2 cores, float32), not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096

    @property
    def params_per_layer(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        return attn + 3 * h * self.intermediate_size  # gate, up, down

    @property
    def num_matmul_params(self) -> int:
        """Weights every token multiplies through: all layers plus the LM head."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    peak_flops: float  # FLOP/s at `dtype_bytes`, dense
    mem_bandwidth: float  # bytes/s
    memory_bytes: float  # device memory (weights + KV pool)
    dtype_bytes: int = 2
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s kernels reach
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 1.5e-3  # scheduling, launch and sampling cost per step
    interconnect_bandwidth: float = 450e9  # bytes/s one way per device (all-reduce bus)
    allreduce_latency_s: float = 10e-6  # per all-reduce call

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency


GiB = 1024 ** 3

MODEL_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9,
                               num_kv_heads=3, head_dim=64, intermediate_size=1536,
                               vocab_size=49152, max_position_embeddings=8192),
    "llama-7b": ModelShape("llama-7b", num_layers=32, hidden_size=4096, num_heads=32,
                           num_kv_heads=32, head_dim=128, intermediate_size=11008,
                           vocab_size=32000, max_position_embeddings=4096),
}

HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "a100-80gb": HardwareProfile("a100-80gb", peak_flops=312e12, mem_bandwidth=2.039e12,
                                 memory_bytes=80 * GiB, interconnect_bandwidth=300e9),
    "h100": HardwareProfile("h100", peak_flops=989e12, mem_bandwidth=3.35e12,
                            memory_bytes=80 * GiB, interconnect_bandwidth=450e9),
    "h200": HardwareProfile("h200", peak_flops=989e12, mem_bandwidth=4.8e12,
                            memory_bytes=141 * GiB, interconnect_bandwidth=450e9),
    # Approximate: ~100 GFLOP/s float32 and ~20 GB/s for 2 AVX2 EPYC cores; already effective.
    "cpu-epyc-2c": HardwareProfile("cpu-epyc-2c", peak_flops=100e9, mem_bandwidth=20e9,
                                   memory_bytes=16 * GiB, dtype_bytes=4, compute_efficiency=1.0,
                                   bandwidth_efficiency=1.0, step_overhead_s=5e-3,
                                   interconnect_bandwidth=10e9, allreduce_latency_s=50e-6),
}


def get_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}") from None


def get_hardware(name: str) -> HardwareProfile:
    try:
        return HARDWARE_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; known: {sorted(HARDWARE_PROFILES)}") from None
