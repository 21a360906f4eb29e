"""Assemble a Simulation from flat engine arguments, a model shape and a hardware profile."""

from __future__ import annotations

from typing import Any, Optional

from tokenweir.config import EngineConfig
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.sim.hardware import GiB, get_hardware, get_shape
from tokenweir.sim.latency import FittedLatencyModel, RooflineLatencyModel
from tokenweir.sim.setup import EngineSetup, Recording
from tokenweir.sim.simulator import Simulation
from tokenweir.sim.workload import RequestSpec

PCIE_BYTES_PER_S = 25e9  # host <-> device copies for swap
GPU_MEMORY_UTILIZATION = 0.9


def is_fitted(model) -> bool:
    """A `tokenweir calibrate` profile, bare or wrapped (NoisyLatencyModel keeps it in
    `base`): it carries its own KV size and context length instead of a shape and hardware."""
    return isinstance(getattr(model, "base", model), FittedLatencyModel)


def pool_blocks(config: EngineConfig, kwargs: dict[str, Any], model: RooflineLatencyModel,
                pp_size: int = 1) -> int:
    """KV pool size per instance, null block included: the explicit override, else an
    explicit kv_cache_space, else what its tp * pp devices hold after the weights (90%
    utilisation; pipeline stages each hold 1/pp of the weights and of the KV). A fitted
    profile sizes the pool as the real engine does: override, else kv_cache_space (default
    included)."""
    if config.cache.num_gpu_blocks_override is not None:
        return config.cache.num_gpu_blocks_override
    block_bytes = block_size_bytes(config, model)
    if "kv_cache_space" in kwargs or is_fitted(model):
        return int(config.cache.kv_cache_space * GiB // block_bytes) + 1
    hw, shape = model.hardware, model.shape
    devices = model.tp * pp_size
    free = (hw.memory_bytes * devices * GPU_MEMORY_UTILIZATION
            - shape.num_weight_params * hw.dtype_bytes)
    if free <= block_bytes:
        raise ValueError(f"{shape.name} weights do not fit {devices} x {hw.name}")
    return int(free // block_bytes) + 1


def block_size_bytes(config: EngineConfig, model: RooflineLatencyModel) -> int:
    if is_fitted(model):
        if not model.kv_bytes_per_token:
            raise ValueError("the fitted profile has no kv_bytes_per_token: give "
                             "num_gpu_blocks_override")
        return config.cache.block_size * model.kv_bytes_per_token
    return config.cache.block_size * model.shape.kv_bytes_per_token(model.hardware.dtype_bytes)


def host_pool_and_costs(config: EngineConfig, model) -> tuple[int, PreemptionCosts]:
    """Host (swap) pool size in blocks (0 under recompute) and the preemption costs the
    latency model implies: prefill time per token at a 2048-token chunk, swap over PCIe."""
    block_bytes = block_size_bytes(config, model)
    num_host_blocks = (int(config.cache.swap_space * GiB // block_bytes)
                       if config.scheduler.preemption_mode != "recompute" else 0)
    probe = 2048
    costs = PreemptionCosts(prefill_seconds_per_token=model.step_time([(probe, 0)]) / probe,
                            swap_seconds_per_block=block_bytes / PCIE_BYTES_PER_S)
    return num_host_blocks, costs


def engine_setup(kwargs: dict[str, Any], model_shape: str = "llama-7b", hardware: str = "h100",
                 tp: int = 1, latency_model: Optional[RooflineLatencyModel] = None,
                 pp_size: int = 1) -> EngineSetup:
    """The config of flat engine arguments (`model` ignored), the latency model (the roofline
    of the shape on the hardware unless given), the context length (config, else a fitted
    profile's, else the shape's), the pool per instance and the preemption costs."""
    config = EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k != "model"})
    shape = get_shape(model_shape)
    model = latency_model or RooflineLatencyModel(shape, get_hardware(hardware), tp)
    max_model_len = (config.model.max_model_len
                     or (is_fitted(model) and model.max_model_len)
                     or shape.max_position_embeddings)
    num_host_blocks, costs = host_pool_and_costs(config, model)
    return EngineSetup(config, model, shape, max_model_len,
                       pool_blocks(config, kwargs, model, pp_size), num_host_blocks, costs)


def build_simulation(kwargs: dict[str, Any], specs: list[RequestSpec],
                     model_shape: str = "llama-7b", hardware: str = "h100", tp: int = 1,
                     latency_model: Optional[RooflineLatencyModel] = None,
                     **sim_kw: Any) -> Simulation:
    """One instance. `sim_kw`: `pp_size`, `sessions`, and Recording's fields."""
    pp_size, sessions = sim_kw.pop("pp_size", 1), sim_kw.pop("sessions", None)
    setup = engine_setup(kwargs, model_shape, hardware, tp, latency_model, pp_size)
    return Simulation(setup, specs, Recording(**sim_kw), pp_size, sessions)
