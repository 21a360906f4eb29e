"""Prometheus export: a collector on a private CollectorRegistry (no global state) that reads
the engine thread's latest snapshot and the per-request histograms at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.metrics import PREFIX, Counter, Gauge, Histogram, _HistogramData


def _buckets(cumulative: dict[float, int]) -> list[tuple[str, int]]:
    return [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in cumulative.items()]


def _histogram(name: str, doc: str, data: _HistogramData, labels: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), _buckets(data.cumulative()), data.sum)
    return family


# vLLM's help texts for the names it shares with us; the others are described by their name.
_DOCS = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}
# Finish reasons exported (at 0) before any request ends with them, as vLLM does.
FINISH_REASONS = ("stop", "length", "abort", "error")


def _doc(name: str) -> str:
    short = name[len(PREFIX):] if name.startswith(PREFIX) else name
    return _DOCS.get(short, short.replace("_", " ") + ".")


def _labeled_counters(snapshot, keys: list, values: list) -> list[CounterMetricFamily]:
    """Counters that carry their own labels (preemptions by cause, SLO attainment by class):
    one family per name, one sample per label set."""
    families: dict[str, CounterMetricFamily] = {}
    for metric in snapshot:
        if not (isinstance(metric, Counter) and metric.labels):
            continue
        names = [k for k, _ in metric.labels]
        family = families.get(metric.name)
        if family is None:
            family = families[metric.name] = CounterMetricFamily(
                metric.name, metric.name, labels=[*keys, *names])
        family.add_metric([*values, *(v for _, v in metric.labels)], metric.value)
    return list(families.values())


class EngineCollector:
    """Labels as vLLM's: `model_name` (the first served name) and `engine` (always "0": one
    engine per server), so a vLLM dashboard needs only the `vllm:` -> `tokenweir:` change."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self):
        keys, values = list(self.labels), list(self.labels.values())
        snapshot = list(self.engine.metrics_snapshot)
        for metric in snapshot:
            if isinstance(metric, Counter) and metric.labels:
                continue  # grouped below: one family per name
            if isinstance(metric, Gauge):
                family = GaugeMetricFamily(metric.name, _doc(metric.name), labels=keys)
                family.add_metric(values, metric.value)
            elif isinstance(metric, Counter):
                family = CounterMetricFamily(metric.name, _doc(metric.name), labels=keys)
                family.add_metric(values, metric.value)
            elif isinstance(metric, Histogram):
                family = HistogramMetricFamily(metric.name, _doc(metric.name), labels=keys)
                family.add_metric(values, _buckets(metric.buckets), metric.sum)
            else:
                continue
            yield family
        yield from _labeled_counters(snapshot, keys, values)
        stats = self.engine.stats
        with self.engine.stats_lock:  # build under the lock, yield after
            families = self._request_families(stats, keys, values)
        yield from families

    def _request_families(self, stats, keys, values) -> list:
        seconds = (("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    stats.ttft),
                   ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                    stats.itl),
                   ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                    stats.e2e),
                   ("request_queue_time_seconds",
                    "Histogram of time spent in WAITING phase for request.", stats.queue))
        return [*(_histogram(PREFIX + name, doc, data, self.labels)
                  for name, doc, data in seconds),
                self._success(stats, keys, values)]

    @staticmethod
    def _success(stats, keys, values) -> CounterMetricFamily:
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Count of finished requests by finish reason.",
                                      labels=[*keys, "finished_reason"])
        for reason in sorted({*FINISH_REASONS, *stats.finished}):
            success.add_metric([*values, reason], stats.finished.get(reason, 0))
        return success


def make_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
