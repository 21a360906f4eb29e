"""Engine metrics named as vLLM names them, under the `tokenweir:` prefix.

`EngineMetrics.snapshot(scheduler)` returns counters, gauges and histograms as plain objects
(what `LLM.get_metrics()` returns); the HTTP server exports the same names to Prometheus.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Union

from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput

PREFIX = "tokenweir:"
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Counter:
    name: str
    value: int
    # Extra Prometheus labels, e.g. (("cause", "memory"),); several Counters may share a name
    # with different labels (one family).
    labels: tuple[tuple[str, str], ...] = ()


@dataclass
class Gauge:
    name: str
    value: float


@dataclass
class Histogram:
    name: str
    count: int
    sum: float
    buckets: dict[float, int]  # upper bound -> cumulative count (Prometheus style)


Metric = Union[Counter, Gauge, Histogram]


@dataclass
class _HistogramData:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> dict[float, int]:
        out, total = {}, 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out[bound] = total
        return out


class EngineMetrics:
    def __init__(self) -> None:
        self.iteration_tokens = _HistogramData(ITERATION_TOKEN_BUCKETS)
        self.busy_seconds = 0.0

    def record_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                    scheduler) -> None:
        if scheduler_output.total_num_scheduled_tokens:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        if runner_output.step_seconds:
            self.busy_seconds += runner_output.step_seconds

    def snapshot(self, scheduler) -> list[Metric]:
        stats = scheduler.stats
        it = self.iteration_tokens
        return [
            Gauge(PREFIX + "num_requests_running", scheduler.num_running),
            Gauge(PREFIX + "num_requests_waiting", scheduler.num_waiting),
            Gauge(PREFIX + "kv_cache_usage_perc", scheduler.kv.usage()),
            Counter(PREFIX + "num_preemptions", stats.num_preemptions),
            Counter(PREFIX + "prompt_tokens", stats.prompt_tokens),
            Counter(PREFIX + "generation_tokens", stats.generation_tokens),
            Counter(PREFIX + "num_steps", stats.num_steps),
            Counter(PREFIX + "num_chunked_prefills", stats.num_chunked_prefill_steps),
            Counter(PREFIX + "recomputed_tokens", stats.recomputed_tokens),
            Counter(PREFIX + "prefix_cache_queries", scheduler.kv.prefix_stats.queries),
            Counter(PREFIX + "prefix_cache_hits", scheduler.kv.prefix_stats.hits),
            Counter(PREFIX + "num_swapped_out", stats.num_swapped_out),
            Counter(PREFIX + "num_swapped_in", stats.num_swapped_in),
            Histogram(PREFIX + "iteration_tokens_total", it.count, it.sum, it.cumulative()),
            *slo_metrics(stats),
        ]


def slo_metrics(stats) -> list[Metric]:
    """Preemption events by cause, the work mid-step cuts threw away (tokens x layers run),
    and TTFT-target attainment per request class (the request's priority)."""
    metrics: list[Metric] = [
        Counter(PREFIX + "num_preemptions_by_cause", n, (("cause", cause),))
        for cause, n in stats.preemptions_by_cause.items()]
    metrics += [Counter(PREFIX + "slo_cut_steps", stats.slo_cut_steps),
                Counter(PREFIX + "slo_cut_wasted_layer_tokens", stats.slo_wasted_layer_tokens),
                Counter(PREFIX + "slo_cut_total_layer_tokens", stats.slo_total_layer_tokens)]
    for slo_class, (met, missed) in sorted(stats.slo_attainment.items()):
        labels = (("slo_class", slo_class),)
        metrics += [Counter(PREFIX + "slo_ttft_met", met, labels),
                    Counter(PREFIX + "slo_ttft_missed", missed, labels)]
    return metrics
