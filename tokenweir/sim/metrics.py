"""Metrics of a simulation: latency percentiles, throughput, goodput, preemption and recompute
tax, KV usage and batch composition."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.simulator import SimResult

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def describe(values) -> dict[str, float]:
    if isinstance(values, ValueCounts):
        by_p = values.percentiles(PERCENTILES)
        return {"mean": values.mean(), **{f"p{p}": by_p[p] for p in PERCENTILES}}
    ordered = sorted(values)
    n = len(ordered)
    out = {"mean": math.fsum(ordered) / n if n else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p)
    return out


def summarize(result: SimResult, ttft_slo_ms: Optional[float] = None,
              tpot_slo_ms: Optional[float] = None) -> dict:
    """A flat dict of metrics (seconds unless named _ms). A request meets its SLO when its TTFT
    is within its own `ttft_slo_ms` (else the global one) and its TPOT within `tpot_slo_ms`;
    an unset SLO always holds."""
    reqs = [r for r in result.requests if r.finished is not None]
    ttft = [r.first_token - r.arrival for r in reqs]
    e2e = [r.finished - r.arrival for r in reqs]
    tpot = [(r.finished - r.first_token) / (r.num_output - 1) for r in reqs if r.num_output > 1]
    span = result.end_time - min((r.arrival for r in result.requests), default=0.0)
    generated = sum(r.num_output for r in reqs)
    prompt = sum(r.prompt_len for r in reqs)
    good = sum(1 for r in reqs if _meets_slo(r, ttft_slo_ms, tpot_slo_ms))
    stats = result.stats
    out: dict = {
        "num_requests": len(result.requests),
        "num_finished": len(reqs),
        "sim_seconds": span,
        "wall_seconds": result.wall_seconds,
        "num_steps": stats.num_steps,
        "request_throughput": len(reqs) / span if span > 0 else math.nan,
        "output_token_throughput": generated / span if span > 0 else math.nan,
        "total_token_throughput": (generated + prompt) / span if span > 0 else math.nan,
        "goodput": good / span if span > 0 else math.nan,
        "slo_attainment": good / len(reqs) if reqs else math.nan,
        "preemptions": stats.num_preemptions,
        "recomputed_tokens": stats.recomputed_tokens,
        "recompute_tax": stats.recomputed_tokens / generated if generated else 0.0,
        "prefix_hit_rate": (result.prefix_hit_tokens / result.prefix_query_tokens
                            if result.prefix_query_tokens else 0.0),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", result.itl), ("e2e", e2e)):
        for stat, value in describe(values).items():
            out[f"{name}_{stat}_ms"] = value * 1000
    if result.steps:
        steps = result.steps
        out["kv_usage_mean"] = math.fsum(s.kv_usage for s in steps) / len(steps)
        out["kv_usage_max"] = max(s.kv_usage for s in steps)
        out["batch_reqs_mean"] = sum(s.num_reqs for s in steps) / len(steps)
        out["batch_decode_frac"] = (sum(s.num_decode_reqs for s in steps)
                                    / max(1, sum(s.num_reqs for s in steps)))
        out["batch_tokens_mean"] = sum(s.num_tokens for s in steps) / len(steps)
    return out


def _meets_slo(r, ttft_slo_ms: Optional[float], tpot_slo_ms: Optional[float]) -> bool:
    limit = r.ttft_slo_ms if r.ttft_slo_ms is not None else ttft_slo_ms
    if limit is not None and (r.first_token - r.arrival) * 1000 > limit:
        return False
    if tpot_slo_ms is not None and r.num_output > 1:
        if (r.finished - r.first_token) / (r.num_output - 1) * 1000 > tpot_slo_ms:
            return False
    return True


def format_report(metrics: dict) -> str:
    lines = []
    for key, value in metrics.items():
        if isinstance(value, float):
            lines.append(f"{key:28s} {value:,.4f}")
        else:
            lines.append(f"{key:28s} {value}")
    return "\n".join(lines)
