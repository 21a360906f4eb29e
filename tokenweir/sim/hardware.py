"""Model shapes and hardware profiles the analytic latency model reads.

Shapes: two built in here (`smollm2-135m`, `llama-7b`); any other comes from a Hugging Face
config.json (sim/model_config.py, which also ships a table of common models). Hardware: GPU
figures are published dense peaks per dtype and HBM bandwidths (vendor data sheets, SXM
parts), CPU figures computed from core counts and memory channels; every profile names its
source. The efficiency factors turn peaks into what kernels reach. `cpu-epyc-2c` is
APPROXIMATE: a rough figure for this machine kind (AVX2 EPYC, 2 cores, float32).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

# the shapes live in shape.py (model_config.py reads them too); re-exported here, where
# callers have always found them
from tokenweir.sim.shape import MODEL_SHAPES, ModelShape  # noqa: F401


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
    # dense peak FLOP/s per dtype (the vendor's figure; `with_dtype` switches to one)
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()
    source: str = ""  # where each figure comes from

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency

    def with_dtype(self, dtype: str) -> "HardwareProfile":
        """This device running weights and KV in `dtype` (one of `peak_flops_by_dtype`): its
        peak FLOP/s and bytes per element."""
        peaks = dict(self.peak_flops_by_dtype)
        if dtype not in peaks:
            raise ValueError(f"{self.name} has no {dtype} peak; known: {sorted(peaks)}")
        return dataclasses.replace(self, name=f"{self.name}:{dtype}", peak_flops=peaks[dtype],
                                   dtype_bytes=DTYPE_BYTES[dtype])


GiB = 1024 ** 3
GB = 1e9
DTYPE_BYTES = {"fp4": 1, "fp8": 1, "int8": 1, "bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}


# Dense (no sparsity) peaks. The first four profiles predate this table and keep their
# figures unchanged, memory in GiB as first written (recorded results depend on them; the
# vendors' "80 GB" is 80e9 bytes, so those pools are ~7% roomier than the parts). New
# profiles use the vendors' decimal GB.
_NV = "NVIDIA {} datasheet (SXM, dense Tensor Core peaks; NVLink {} GB/s bidirectional)"
HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "a100-80gb": HardwareProfile(
        "a100-80gb", peak_flops=312e12, mem_bandwidth=2.039e12, memory_bytes=80 * GiB,
        interconnect_bandwidth=300e9,
        peak_flops_by_dtype=(("bf16", 312e12), ("fp16", 312e12), ("tf32", 156e12),
                             ("fp32", 19.5e12), ("int8", 624e12)),
        source=_NV.format("A100 80GB", 600) + "; HBM2e 2,039 GB/s"),
    "h100": HardwareProfile(
        "h100", peak_flops=989e12, mem_bandwidth=3.35e12, memory_bytes=80 * GiB,
        interconnect_bandwidth=450e9,
        peak_flops_by_dtype=(("bf16", 989e12), ("fp16", 989e12), ("fp8", 1979e12),
                             ("tf32", 494.5e12), ("fp32", 67e12)),
        source=_NV.format("H100 SXM", 900) + "; HBM3 3.35 TB/s"),
    "h200": HardwareProfile(
        "h200", peak_flops=989e12, mem_bandwidth=4.8e12, memory_bytes=141 * GiB,
        interconnect_bandwidth=450e9,
        peak_flops_by_dtype=(("bf16", 989e12), ("fp16", 989e12), ("fp8", 1979e12),
                             ("tf32", 494.5e12), ("fp32", 67e12)),
        source=_NV.format("H200 SXM", 900) + "; 141 GB HBM3e 4.8 TB/s"),
    "b200": HardwareProfile(
        "b200", peak_flops=2.25e15, mem_bandwidth=8e12, memory_bytes=180 * GB,
        interconnect_bandwidth=900e9,
        peak_flops_by_dtype=(("bf16", 2.25e15), ("fp16", 2.25e15), ("fp8", 4.5e15),
                             ("fp4", 9e15), ("tf32", 1.1e15), ("fp32", 75e12)),
        source="NVIDIA HGX B200 datasheet, per GPU (the 8-GPU board's figures / 8, sparse "
               "Tensor Core figures halved): 180 GB HBM3e, 8 TB/s; NVLink 5 1.8 TB/s "
               "bidirectional"),
    "mi300x": HardwareProfile(
        "mi300x", peak_flops=1307.4e12, mem_bandwidth=5.3e12, memory_bytes=192 * GB,
        interconnect_bandwidth=448e9,
        peak_flops_by_dtype=(("bf16", 1307.4e12), ("fp16", 1307.4e12), ("fp8", 2614.9e12),
                             ("tf32", 653.7e12), ("fp32", 163.4e12)),
        source="AMD Instinct MI300X data sheet: dense matrix peaks, 192 GB HBM3 5.3 TB/s, "
               "Infinity Fabric 896 GB/s aggregate peer bandwidth (half one way)"),
    # Approximate: ~100 GFLOP/s float32 and ~20 GB/s for 2 AVX2 EPYC cores; already effective.
    "cpu-epyc-2c": HardwareProfile(
        "cpu-epyc-2c", peak_flops=100e9, mem_bandwidth=20e9, memory_bytes=16 * GiB,
        dtype_bytes=4, compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=5e-3,
        interconnect_bandwidth=10e9, allreduce_latency_s=50e-6,
        peak_flops_by_dtype=(("fp32", 100e9),),
        source="APPROXIMATE, already effective (no efficiency factors): this machine kind, 2 "
               "AVX2 EPYC cores in float32; peak is 2 cores x 32 FLOP/cycle (2 x 256-bit FMA) "
               "x ~3 GHz ~ 190 GFLOP/s, torch matmul measured ~198 GFLOP/s on 2 threads "
               "(/work/shared/FACTS.md); kernels with attention reach about half"),
    "cpu-avx512-socket": HardwareProfile(
        "cpu-avx512-socket", peak_flops=14.7e12, mem_bandwidth=460.8e9,
        memory_bytes=384 * GB, compute_efficiency=0.5, bandwidth_efficiency=0.75,
        step_overhead_s=5e-3, interconnect_bandwidth=128e9, allreduce_latency_s=20e-6,
        peak_flops_by_dtype=(("bf16", 14.7e12), ("fp32", 7.37e12)),
        source="AMD EPYC 9654 (Genoa) product page: 96 Zen 4 cores, 2.4 GHz base, 12 channels "
               "DDR5-4800 = 460.8 GB/s; FLOP/s computed: 96 x 2.4 GHz x 32 fp32 FLOP/cycle "
               "(2 x 256-bit FMA pipes), x2 with AVX512_BF16 dot products; 384 GB = 12 x 32 "
               "GB DIMMs; socket-to-socket xGMI approximate"),
}


def get_shape(name: "str | ModelShape") -> ModelShape:
    """A built-in shape or a shipped config by name (`MODEL_TABLE` in sim/model_config.py),
    a config.json path (or a model directory holding one), or a ModelShape as it is."""
    if isinstance(name, ModelShape):
        return name
    from tokenweir.sim.model_config import MODEL_TABLE, load_model_config

    if name in MODEL_TABLE:
        return MODEL_TABLE[name]()
    if name.endswith(".json") or os.path.isdir(name):
        return load_model_config(name)
    raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_TABLE)} "
                     f"(or a config.json path)")


def get_hardware(name: str) -> HardwareProfile:
    """A hardware profile by name; `NAME:DTYPE` (e.g. h100:fp8) runs it in that dtype."""
    base, _, dtype = name.partition(":")
    try:
        profile = HARDWARE_PROFILES[base]
    except KeyError:
        raise ValueError(
            f"unknown hardware {name!r}; known: {sorted(HARDWARE_PROFILES)}") from None
    return profile.with_dtype(dtype) if dtype else profile
