"""SLO metrics: preemptions by cause, cut waste and attainment per class reach get_metrics and
the Prometheus exposition (one family per name, one sample per label set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from tests.core.test_slo_scheduler import drive, long_and_urgent, slo_scheduler
from tests.core.harness import FakeRunner
from tokenweir.engine.metrics import PREFIX, slo_metrics
from tokenweir.server.metrics import _labeled_counters


def _stats_after_a_pause():
    scheduler = slo_scheduler()
    long, urgent = long_and_urgent()
    urgent.priority = 2
    drive(scheduler, FakeRunner(), [(0.0, long), (1.0, urgent)])
    return scheduler.stats


def test_slo_metrics_carry_causes_waste_and_classes():
    metrics = {(m.name, m.labels): m.value for m in slo_metrics(_stats_after_a_pause())}
    assert metrics[(PREFIX + "num_preemptions_by_cause", (("cause", "slo-between-steps"),))] == 1
    assert metrics[(PREFIX + "num_preemptions_by_cause", (("cause", "memory"),))] == 0
    assert metrics[(PREFIX + "slo_ttft_met", (("slo_class", "2"),))] == 1
    assert metrics[(PREFIX + "slo_ttft_missed", (("slo_class", "2"),))] == 0
    assert metrics[(PREFIX + "slo_cut_wasted_layer_tokens", ())] == 0


def test_labeled_counters_render_as_one_family_per_name():
    snapshot = slo_metrics(_stats_after_a_pause())
    families = _labeled_counters(snapshot, ["model_name"], ["m"])

    class Fixed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    assert text.count("# TYPE tokenweir:num_preemptions_by_cause_total counter") == 1
    assert 'tokenweir:num_preemptions_by_cause_total{cause="slo-mid-step",model_name="m"} 0.0' \
        in text
    assert 'tokenweir:slo_ttft_met_total{model_name="m",slo_class="2"} 1.0' in text
