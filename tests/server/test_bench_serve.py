"""`tokenweir bench serve` without a server: seeded workloads, arrivals, summaries, goodput.
(The live run against a real server is in test_server.py.)"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tokenweir.bench import serve as bench
from tokenweir.cli.flags import default_namespace
from tokenweir.config import BenchServeConfig


def _args(**overrides) -> argparse.Namespace:
    ns = default_namespace(BenchServeConfig)
    for name, value in overrides.items():
        setattr(ns, name, value)
    return ns


@pytest.mark.parametrize("dist", ["fixed", "uniform", "lognormal"])
def test_workload_is_seeded_and_shaped(dist):
    args = _args(num_prompts=400, input_len=100, output_len=40, length_dist=dist, seed=5)
    items = bench.make_workload(args)
    again = bench.make_workload(args)
    assert [i.prompt for i in items] == [i.prompt for i in again]
    assert [i.prompt for i in items] != [i.prompt for i in bench.make_workload(_args(
        num_prompts=400, input_len=100, output_len=40, length_dist=dist, seed=6))]
    ins = np.array([len(i.prompt) for i in items])
    outs = np.array([i.output_len for i in items])
    assert all(len(i.prompt) == i.prompt_len for i in items)
    if dist == "fixed":
        assert set(ins) == {100} and set(outs) == {40}
    elif dist == "uniform":
        assert ins.min() >= 50 and ins.max() <= 150 and len(set(ins)) > 50
        assert outs.min() >= 20 and outs.max() <= 60
    else:
        assert abs(ins.mean() - 100) < 10 and ins.std() > 20  # lognormal keeps the mean
    assert all(100 <= t < args.vocab_size for i in items for t in i.prompt)


def test_arrivals_poisson_rate_and_burstiness():
    gaps = np.array(bench.arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0))
    assert abs(gaps.mean() - 0.25) < 0.01 and abs(gaps.std() - 0.25) < 0.015  # exponential
    bursty = np.array(bench.arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0))
    assert abs(bursty.mean() - 0.25) < 0.02 and bursty.std() > 1.8 * gaps.std()
    assert bench.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def _result(ttft, latency, tokens, ok=True):
    return bench.RequestResult(success=ok, ttft=ttft, latency=latency, output_tokens=tokens,
                               prompt_len=10, itl=[(latency - ttft) / max(1, tokens - 1)] *
                               max(0, tokens - 1), error="" if ok else "boom")


def test_summary_figures_and_goodput():
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 11), _result(0.0, 0.0, 0, ok=False)]
    s = bench.summarize(results, duration=2.0, args=_args(goodput=["ttft:200", "tpot:150"]))
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["total_output_tokens"] == 22 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(11.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)  # (100 ms + 200 ms) / 2
    assert s["median_e2el_ms"] == pytest.approx(1700.0)
    assert s["request_goodput"] == pytest.approx(0.5)  # only the first meets ttft <= 200 ms
    with pytest.raises(ValueError):
        bench.parse_goodput(["latency:5"])
