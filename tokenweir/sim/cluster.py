"""Several instances behind a router: building a cluster for the simulator's one event loop
(simulator.py), and reporting on its run.

A cluster is `num_instances` mixed instances, or with `pd=(P, D)` P prefill and D decode
instances (prefill/decode disaggregation, disagg.py), each a real Scheduler + KVCacheManager +
SimRunner (instance.py) with `pp_size` pipeline stages. One instance with pp_size 1 is exactly
what `build_simulation` makes: the same loop, step for step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from tokenweir.config import EngineConfig
from tokenweir.sim.build import engine_setup, is_fitted
from tokenweir.sim.instance import Instance
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.routing import make_router
from tokenweir.sim.setup import Recording
from tokenweir.sim.sessions import Session
from tokenweir.sim.simulator import ClusterResult, Simulator
from tokenweir.sim.workload import RequestSpec


# ---- building ------------------------------------------------------------------------------
def parse_pd(text: Optional[str]) -> Optional[tuple[int, int]]:
    """'P:D' -> (P, D), both >= 1; None or '' -> None."""
    if not text:
        return None
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"bad --pd {text!r}: use P:D, e.g. 1:3") from None
    if p < 1 or d < 1:
        raise ValueError(f"bad --pd {text!r}: need at least one prefill and one decode instance")
    return p, d


def build_cluster(kwargs: dict[str, Any], specs: list[RequestSpec],
                  model_shape: str = "llama-7b", hardware: str = "h100", tp: int = 1,
                  pp_size: int = 1, num_instances: int = 1, router: str = "round-robin",
                  pd: Optional[tuple[int, int]] = None, link_gbps: float = 100.0,
                  sessions: Optional[list[Session]] = None,
                  latency_model: Optional[RooflineLatencyModel] = None,
                  record_steps: bool = True, record_itl_times: bool = False,
                  check: bool = False, record_itl: bool = True,
                  itl_counts: bool = False) -> Simulator:
    """The simulator for a cluster; `latency_model` may be a fitted profile (`tokenweir
    calibrate`), which then also gives the context length and the KV bytes per token."""
    setup = engine_setup(kwargs, model_shape, hardware, tp, latency_model, pp_size)
    config, model = setup.config, setup.model
    _check_layout(config, model, num_instances, pd, link_gbps)
    roles = ["prefill"] * pd[0] + ["decode"] * pd[1] if pd else ["mixed"] * num_instances
    recording = Recording(record_steps, record_itl, itl_counts, record_itl_times, check)
    instances = [Instance(i, setup, role, pp_size, recording) for i, role in enumerate(roles)]
    bs = config.cache.block_size
    num_front = sum(1 for r in roles if r != "decode")
    return Simulator(instances, make_router(router, num_front, bs), specs, sessions,
                     make_router(router, len(roles) - num_front, bs) if pd else None,
                     link_gbps * 1e9 / 8, _kv_bytes_per_token(model, setup.shape))


def _check_layout(config: EngineConfig, model, num_instances: int,
                  pd: Optional[tuple[int, int]], link_gbps: float) -> None:
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    if link_gbps <= 0:
        raise ValueError(f"link_gbps must be positive, got {link_gbps}")
    if pd is not None and not config.cache.enable_prefix_caching:
        raise ValueError("prefill/decode disaggregation hands KV over through the prefix "
                         "cache: enable prefix caching")
    if pd is not None and is_fitted(model) and not model.kv_bytes_per_token:
        raise ValueError("prefill/decode disaggregation needs the KV bytes per token: the "
                         "fitted profile has no kv_bytes_per_token")


def _kv_bytes_per_token(model, shape) -> int:
    if is_fitted(model):
        return model.kv_bytes_per_token
    return shape.kv_bytes_per_token(model.hardware.dtype_bytes)


# ---- reporting -----------------------------------------------------------------------------
def summarize_cluster(result: ClusterResult, ttft_slo_ms: Optional[float] = None,
                      tpot_slo_ms: Optional[float] = None) -> dict:
    """{'overall': metrics over user requests, 'instances': one metrics dict per instance}."""
    from tokenweir.sim.metrics import summarize

    overall = summarize(result.overall, ttft_slo_ms, tpot_slo_ms)
    overall["num_instances"] = len(result.instances)
    overall["num_sessions"] = result.num_sessions
    if result.transfers:
        waits = [t.done - t.ready for t in result.transfers]
        overall["kv_transfers"] = len(result.transfers)
        overall["kv_transfer_gb"] = sum(t.num_bytes for t in result.transfers) / 1e9
        overall["kv_handoff_mean_ms"] = sum(waits) / len(waits) * 1000
    instances = []
    for i, r in enumerate(result.instances):
        metrics = summarize(r, ttft_slo_ms, tpot_slo_ms)
        instances.append({"instance": i, "role": result.roles[i], "routed": result.routed[i],
                          "max_in_flight": result.max_in_flight[i], **metrics})
    return {"overall": overall, "instances": instances}


INSTANCE_COLUMNS = (("instance", "{}"), ("role", "{}"), ("routed", "{}"),
                    ("num_steps", "{}"), ("preemptions", "{}"), ("max_in_flight", "{}"),
                    ("ttft_p50_ms", "{:.1f}"), ("itl_p99_ms", "{:.2f}"),
                    ("kv_usage_mean", "{:.3f}"), ("prefix_hit_rate", "{:.3f}"))


def format_instance_table(instances: list[dict]) -> str:
    header = "  ".join(f"{name:>14s}" for name, _ in INSTANCE_COLUMNS)
    rows = [header]
    for m in instances:
        cells = [fmt.format(m.get(name, float("nan"))) for name, fmt in INSTANCE_COLUMNS]
        rows.append("  ".join(f"{c:>14s}" for c in cells))
    return "\n".join(rows)


def cluster_result_json(result: ClusterResult) -> str:
    """Everything a run decided (records, steps, gaps, transfers), without wall-clock time:
    two runs of the same inputs give the same bytes."""
    body = {"requests": [dataclasses.asdict(r) for r in result.overall.requests],
            "instances": [{"requests": [dataclasses.asdict(x) for x in r.requests],
                           "steps": [dataclasses.asdict(s) for s in r.steps],
                           "itl": list(r.itl), "stats": dataclasses.asdict(r.stats)}
                          for r in result.instances],
            "routed": result.routed, "max_in_flight": result.max_in_flight,
            "transfers": [dataclasses.asdict(t) for t in result.transfers],
            "end": result.overall.end_time}
    return json.dumps(body, sort_keys=True)
