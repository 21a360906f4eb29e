"""benchmarks/slo_real.py: its workload, its statistics, and the quick mode end to end on a
tiny random-weight Llama (real engine runs, a profile calibrated from their traces, the
simulator's prediction beside them)."""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks.slo_real")


def test_items_scale_the_mixed_workload_and_set_targets_from_solo_ttfts():
    bench = _bench()
    items = bench.make_items(400, seed=3, scale=0.125, solo=lambda n: n / 1000)
    chat, docs = (16, 128), (256, 768)
    assert all(chat[0] <= it.prompt_len <= chat[1] or docs[0] <= it.prompt_len <= docs[1]
               for it in items)
    assert 0.1 < sum(it.prompt_len >= docs[0] for it in items) / 400 < 0.3  # 20% documents
    urgent = [it for it in items if it.urgent]
    assert 0.18 < len(urgent) / 400 < 0.32  # a quarter urgent
    assert all(it.ttft_s == pytest.approx((1.5 if it.urgent else 5.0) * it.prompt_len / 1000)
               for it in items)
    assert all(2 <= it.output_len <= 16 for it in items)
    assert [it.unit_arrival for it in items] == sorted(it.unit_arrival for it in items)
    assert items == bench.make_items(400, seed=3, scale=0.125, solo=lambda n: n / 1000)


# Recorded from slo_real's own make_items before it took slo_goodput's draws (the refactor's
# before/after comparison): sha256 of every item's fields, solo TTFT 2 ms + n / 3000 s.
RECORDED_ITEMS = {(0, 0.125): "911f1d48972331950af124d2c262a98e46f25987461a21acec0f1854350fcd58",
                  (3, 0.125): "c105fda08b28e4f3814c8195a5247536ed64d9b675079d921bfcf6cc569248ea",
                  (1, 1 / 32): "408fb29056ef430122d6b5af56d066120e8d46c6331934d23a1eedfd40275483",
                  (2, 1.0): "aeaddc4544a87e0be5615401b1567732fddb713ae26a793e06695f8ea0a3da70"}


def test_items_are_the_recorded_draws():
    bench = _bench()
    for (seed, scale), recorded in RECORDED_ITEMS.items():
        items = bench.make_items(48, seed, scale, lambda n: 0.002 + n / 3000)
        rows = [(it.index, repr(it.unit_arrival), it.prompt_len, it.output_len, it.urgent,
                 repr(it.ttft_s)) for it in items]
        assert hashlib.sha256(repr(rows).encode()).hexdigest() == recorded, (seed, scale)


def test_paired_bootstrap_gain_keeps_pairs_and_bounds_the_gain():
    bench = _bench()
    always = [[(False, True)] * 6, [(False, True)] * 5]
    assert bench.paired_bootstrap_gain(always, 200) == (100.0, 100.0, 100.0)
    none = [[(True, True), (False, False)] * 3] * 3
    assert bench.paired_bootstrap_gain(none, 200) == (0.0, 0.0, 0.0)  # pairs never split
    mixed = [[(False, True), (True, True), (False, False), (True, False)] * 2] * 3
    gain, low, high = bench.paired_bootstrap_gain(mixed, 500)
    assert gain == 0.0 and low < 0 < high


def test_quick_mode_runs_both_policies_and_the_simulator_beside_them(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tests" / "model"))
    from tiny_models import make_tiny_model, save_tiny_tokenizer

    make_tiny_model("llama", str(tmp_path), seed=5)
    save_tiny_tokenizer(str(tmp_path), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    saved = tmp_path / "calibration.json"
    summaries = _bench().main(["--quick", "--model", str(tmp_path), "--reprobe",
                               "--save-calibration", str(saved)])
    out = capsys.readouterr().out
    assert out.count("solo TTFT (median of 1)") == 1 + 2  # at start, then before each pair
    assert [s["load"] for s in summaries] == [0.5, 1.0]
    for s in summaries:
        assert set(s["policies"]) == {"fcfs", "slo"}
        for p in s["policies"].values():
            assert p["throughput"][0] > 0 and p["unfinished"] == 0  # the runs really ran
            assert p["sim_urgent_pct"] is not None  # and the simulator ran them too
        v = s["vs_fcfs"]
        low, high = v["bootstrap_95"]
        assert low <= v["urgent_gain_points"] <= high
        assert "sim_gain" in v
    assert "simulator profile: fitted to 1 calibration run(s)" in out
    assert out.count("targets: gain >= 15 points") == 2

    # --plan: the simulator alone on the saved calibration, at each request count and load
    plans = _bench().main(["--quick", "--plan", str(saved), "--plan-requests", "8", "12"])
    out = capsys.readouterr().out
    assert [(p["requests"], p["load"]) for p in plans] == [(8, 0.5), (8, 1.0), (12, 0.5),
                                                           (12, 1.0)]
    assert out.count("[simulator only, 12 requests per run") == 2
    for p in plans:
        assert p["policies"]["fcfs"]["throughput"][0] > 0 and "vs_fcfs" in p

    # --load-calibration: the saved profile, no calibration run; the first probe serves the
    # first seed (one probe fewer), every later seed is probed anew
    again = _bench().main(["--quick", "--model", str(tmp_path), "--reprobe",
                           "--load-calibration", str(saved)])
    out = capsys.readouterr().out
    assert out.count("solo TTFT (median of 1)") == 1 + 1
    assert "simulator profile: fitted" not in out
    assert all(s["policies"]["slo"]["sim_urgent_pct"] is not None for s in again)
