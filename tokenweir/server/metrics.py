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
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self):
        keys, values = list(self.labels), list(self.labels.values())
        snapshot = list(self.engine.metrics_snapshot)
        for metric in snapshot:
            if isinstance(metric, Counter) and metric.labels:
                continue  # grouped below: one family per name
            if isinstance(metric, Gauge):
                family = GaugeMetricFamily(metric.name, metric.name, labels=keys)
                family.add_metric(values, metric.value)
            elif isinstance(metric, Counter):
                family = CounterMetricFamily(metric.name, metric.name, labels=keys)
                family.add_metric(values, metric.value)
            elif isinstance(metric, Histogram):
                family = HistogramMetricFamily(metric.name, metric.name, labels=keys)
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
        return [
            _histogram(PREFIX + "time_to_first_token_seconds",
                             "Histogram of time to first token in seconds.", stats.ttft,
                             self.labels),
            _histogram(PREFIX + "inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", stats.itl,
                             self.labels),
            _histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", stats.e2e,
                             self.labels),
            _histogram(PREFIX + "request_queue_time_seconds",
                             "Histogram of time spent waiting in the queue in seconds.",
                       stats.queue, self.labels),
            self._success(stats, keys, values)]

    @staticmethod
    def _success(stats, keys, values) -> CounterMetricFamily:
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Count of finished requests by finish reason.",
                                      labels=[*keys, "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *stats.finished}):
            success.add_metric([*values, reason], stats.finished.get(reason, 0))
        return success


def make_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
