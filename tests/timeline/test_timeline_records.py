"""The timeline's data path without a browser: the recorder against the scheduler's own
counts, the chrome-trace converter against the simulator's step records, the page model's
states, aggregation and drop notes, and the self-contained page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from timeline_gen import run_cramped, run_slo
from tokenweir.sim.trace import write_chrome_trace
from tokenweir.cli import main
from tokenweir.timeline import StepRing, Trace, build_page, load_jsonl, render_html, write_jsonl
from tokenweir.timeline.chrome import load_chrome_trace
from tokenweir.timeline.layout import (CUT, DECODE, PAUSED, PREEMPTED, PREFILL, STATES,
                                       SWAPPED, WAITING, page_model)


@pytest.fixture(scope="module")
def slo_run():
    return run_slo("slo")


@pytest.fixture(scope="module")
def recompute_run():
    return run_cramped("recompute")


def _same_steps(result, trace) -> None:
    """Every recorded step agrees with the simulator's own StepRecord."""
    assert len(trace.steps) == len(result.steps) > 0
    for rec, s in zip(trace.steps, result.steps):
        assert rec["start"] == s.start and rec["running"] == s.num_running
        assert rec["waiting"] == s.num_waiting and len(rec["reqs"]) == s.num_reqs
        assert sum(r["prefill"] + r["decode"] for r in rec["reqs"]) == s.num_tokens


def test_recorder_matches_scheduler_under_slo_cuts(slo_run):
    result, trace = slo_run
    _same_steps(result, trace)
    cut_steps = [s for s in trace.steps if s["cut"]]
    # probe: the slo policy really cut steps and paused prefills in this workload
    assert len(cut_steps) == result.stats.slo_cut_steps > 0
    assert result.stats.preemptions_by_cause["slo-between-steps"] > 0
    for s in cut_steps:  # the victim was scheduled in the step that was cut
        assert s["cut"][0] in {r["id"] for r in s["reqs"]}
    assert sum(1 for s in trace.steps if s["paused"]) > 0
    # a request's decode tokens over the run: every output token after the first (a cut
    # step counts for nobody: it is rolled back whole and nothing was sampled)
    decodes: dict[str, int] = {}
    for s in (s for s in trace.steps if not s["cut"]):
        for r in s["reqs"]:
            decodes[r["id"]] = decodes.get(r["id"], 0) + r["decode"]
    for rec in result.requests:
        assert decodes.get(rec.request_id, 0) == rec.num_output - 1


def test_recorder_preemptions_and_swaps(recompute_run):
    result, trace = recompute_run
    _same_steps(result, trace)
    preempted = sum(len(s["preempted"]) for s in trace.steps)
    assert preempted == result.stats.num_preemptions > 0  # probe: the pool was cramped
    swap_result, swap_trace = run_cramped("swap")
    assert swap_result.stats.num_swapped_out > 0
    swapped_ids = {rid for s in swap_trace.steps for rid in s["swapped"]}
    assert swapped_ids and all(not s["preempted"] for s in swap_trace.steps)
    for s in swap_trace.steps:  # a swapped-out request runs nowhere while out
        assert not set(s["swapped"]) & {r["id"] for r in s["reqs"]}


def test_jsonl_round_trip(tmp_path, slo_run):
    _, trace = slo_run
    write_jsonl(trace, tmp_path / "t.jsonl")
    back = load_jsonl(tmp_path / "t.jsonl")
    assert back.steps == json.loads(json.dumps(trace.steps))
    assert back.requests.keys() == trace.requests.keys() and back.meta == trace.meta
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "start": 0}\n')
    with pytest.raises(ValueError, match="duration"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_chrome_trace_converter(tmp_path):
    result, _ = run_cramped("recompute", num_requests=40, blocks=4000)
    assert result.stats.num_preemptions == 0  # no preemption: spans tell the whole story
    write_chrome_trace(result, str(tmp_path / "c.json"))
    trace = load_chrome_trace(tmp_path / "c.json")
    assert len(trace.steps) == len(result.steps)
    for rec, s in zip(trace.steps, result.steps):
        assert rec["start"] == pytest.approx(s.start) and rec["kv_usage"] == s.kv_usage
        assert sum(r["prefill"] + r["decode"] for r in rec["reqs"]) == s.num_tokens
        assert sum(r["decode"] for r in rec["reqs"]) == s.num_decode_reqs
        assert all(r["estimated"] for r in rec["reqs"])
    assert {r.request_id for r in result.requests} == set(trace.requests)


def _expected_state(step: dict, rid: str) -> int:
    if rid in step["cut"]:
        return CUT
    if rid in step["preempted"]:
        return PREEMPTED
    ran = {r["id"]: r for r in step["reqs"]}
    if rid in ran:
        return PREFILL if ran[rid]["prefill"] else DECODE
    if rid in step["swapped"]:
        return SWAPPED
    return PAUSED if rid in step["paused"] else WAITING


def test_page_model_states(slo_run):
    _, trace = slo_run
    model = page_model([trace])
    panel = model["panels"][0]
    seen = set()
    for step in trace.steps:
        ids = {r["id"] for r in step["reqs"]} | set(step["paused"]) | set(step["preempted"])
        for rid in ids:
            runs = panel["rows"][rid]
            run = next(r for r in runs if r[0] <= step["step"] < r[0] + r[1])
            assert run[2] == _expected_state(step, rid), (step["step"], rid)
            seen.add(run[2])
    assert {CUT, PREEMPTED, PREFILL, DECODE, PAUSED} <= seen
    assert model["rowIds"][:3] == ["r0", "r1", "r2"] and panel["notes"] == []


def test_aggregation_and_dropped_rows_are_reported(recompute_run):
    _, trace = recompute_run
    model = page_model([trace], max_rows=50, max_columns=1000)
    panel = model["panels"][0]
    bucket = -(-len(trace.steps) // 1000)
    assert panel["bucket"] == bucket and len(panel["cols"]["start"]) <= 1000
    assert len(model["rowIds"]) == 50 and len(panel["rows"]) == 50
    notes = " ".join(panel["notes"])
    assert f"aggregated {len(trace.steps)} steps" in notes and "dropped 70 requests" in notes
    assert sum(panel["cols"]["prefill"]) + sum(panel["cols"]["decode"]) == sum(
        r["prefill"] + r["decode"] for s in trace.steps for r in s["reqs"])


def test_page_is_self_contained(tmp_path, slo_run, recompute_run):
    _, trace = slo_run
    trace.requests["r0"] = {**trace.requests["r0"], "note": "</script><b>x"}
    page = render_html(trace.steps, trace.requests, label="live", refresh_seconds=2)
    assert page.count("</script>") == 3  # the data cannot close its element early
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "refreshSeconds" in page and all(name in page for name in STATES)
    out = build_page([trace, recompute_run[1]], tmp_path / "two.html")
    assert out.stat().st_size > 10_000


def test_cli_main_chrome_trace(tmp_path):
    result, _ = run_cramped("recompute", num_requests=30)
    write_chrome_trace(result, str(tmp_path / "c.json"))
    assert main(["timeline", str(tmp_path / "c.json"), "-o", str(tmp_path / "p.html"),
                 "--write-records", str(tmp_path / "r.jsonl")]) == 0
    assert "timeline-data" in (tmp_path / "p.html").read_text()
    assert len(load_jsonl(tmp_path / "r.jsonl").steps) == len(result.steps)


def test_step_ring_keeps_the_latest():
    ring = StepRing(capacity=3)
    for i in range(5):
        ring.add_request({"id": f"r{i}", "arrival": i})
        ring.add_step({"step": i, "start": i, "duration": 1, "reqs": [{"id": f"r{i}"}]})
    trace = ring.trace()
    assert [s["step"] for s in trace.steps] == [2, 3, 4] and ring.num_dropped == 2
    assert "2 older ones were dropped" in trace.meta["note"]


def test_chrome_converter_picks_one_instance_of_a_cluster_trace():
    from tokenweir.sim.trace import chrome_trace_events
    from tokenweir.timeline.chrome import convert_events

    small, _ = run_cramped("recompute", num_requests=20, blocks=4000)
    large, _ = run_cramped("recompute", num_requests=40, blocks=4000)
    events = (chrome_trace_events(small, pid=1, process_name="instance 0", id_prefix="0:")
              + chrome_trace_events(large, pid=2, process_name="instance 1", id_prefix="1:"))
    first, second = convert_events(events), convert_events(events, pid=2)
    assert (len(first.steps), len(second.steps)) == (len(small.steps), len(large.steps))
    assert (first.label, second.label) == ("instance 0", "instance 1")
    assert len(second.requests) == 40 and set(first.requests) < set(second.requests)


def test_engine_trace_and_its_simulation_side_by_side(tmp_path):
    """A real-engine style trace (phases, raw clock) and a simulation open together: one
    HTML page of two panels, and one Chrome file of two processes whose steps load back."""
    from tokenweir.timeline.chrome import convert_events

    _, sim = run_cramped("recompute", num_requests=20, blocks=4000)
    engine = Trace([{**s, "start": s["start"] + 5000.0, "phases": {
        "schedule": 0.1 * s["duration"], "forward": 0.8 * s["duration"]}} for s in sim.steps],
        {k: {**r, **{f: r[f] + 5000.0 for f in ("arrival", "first_token", "finished")}}
         for k, r in sim.requests.items()}, {"source": "engine", "label": "engine"})
    write_jsonl(engine, tmp_path / "e.jsonl")
    write_jsonl(sim, tmp_path / "s.jsonl")
    assert main(["timeline", str(tmp_path / "e.jsonl"), str(tmp_path / "s.jsonl"), "-o",
                 str(tmp_path / "p.html"), "--write-chrome", str(tmp_path / "both.json")]) == 0
    events = json.loads((tmp_path / "both.json").read_text())["traceEvents"]
    first, second = convert_events(events, pid=1), convert_events(events, pid=2)
    assert len(first.steps) == len(second.steps) == len(sim.steps)
    # both start at their first arrival: the engine's clock offset is gone
    assert first.steps[0]["start"] == pytest.approx(second.steps[0]["start"], abs=1e-6)
    assert sum(e.get("cat") == "phase" for e in events) == 2 * len(sim.steps)


def test_simulate_writes_step_records_that_timeline_compares(tmp_path, capsys):
    """`simulate --step-records` writes what `timeline A B` reads (issue 34: no command wrote
    them for a simulation); the records agree with the run's own metrics."""
    runs = {}
    for policy in ("fcfs", "priority"):
        records, metrics = tmp_path / f"{policy}.jsonl", tmp_path / f"{policy}.json"
        assert main(["simulate", "--num-requests", "40", "--request-rate", "20",
                     "--num-gpu-blocks-override", "120", "--max-model-len", "1024",
                     "--priority-mix", "0:0.5,1:0.5",
                     "--scheduling-policy", policy, "--step-records", str(records),
                     "--json", str(metrics)]) == 0
        runs[policy] = (load_jsonl(records), json.loads(metrics.read_text()))
    for trace, metrics in runs.values():
        assert len(trace.requests) == metrics["num_finished"] == 40
        assert len(trace.steps) == metrics["num_steps"] > 0
        assert sum(r["decode"] for s in trace.steps for r in s["reqs"]) == sum(
            r["output_len"] - 1 for r in trace.requests.values())  # all but each first
        assert trace.meta["source"] == "simulator"
    assert runs["fcfs"][0].steps != runs["priority"][0].steps  # probe: two different runs
    page = tmp_path / "compare.html"
    assert main(["timeline", str(tmp_path / "fcfs.jsonl"), str(tmp_path / "priority.jsonl"),
                 "-o", str(page)]) == 0
    assert "fcfs.jsonl" in capsys.readouterr().out and page.stat().st_size > 0


def test_simulate_step_records_refuse_what_they_cannot_record(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "8", "--num-instances", "2",
                 "--step-records", str(tmp_path / "x.jsonl")]) == 2
    assert "--step-records records one instance" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_rows_sort_in_natural_order_when_arrivals_tie():
    ids = [f"r{i}" for i in (10, 2, 0, 100, 1, 11, 3)]
    assert sorted(ids) != sorted(ids, key=lambda r: int(r[1:]))  # probe: text order differs
    steps = [{"step": 0, "start": 0.0, "duration": 0.01, "reqs": [
        {"id": rid, "prefill": 4, "decode": 0, "context": 4} for rid in ids]}]
    requests = {rid: {"id": rid, "arrival": 0.0} for rid in ids}
    model = page_model([Trace(steps, requests, {"label": "t"})])
    assert model["rowIds"] == ["r0", "r1", "r2", "r3", "r10", "r11", "r100"]


def test_long_request_ids_are_shortened_in_the_gutter_not_in_the_data():
    from tokenweir.timeline.layout import ROW_LABEL_CHARS

    long_ids = [f"cmpl-3f9a1b2c4d5e6f7a8b9c-{i}" for i in range(12)]
    ids = long_ids + ["r1", "abcdefghij"]
    steps = [{"step": 0, "start": 0.0, "duration": 0.01, "reqs": [
        {"id": rid, "prefill": 4, "decode": 0, "context": 4} for rid in ids]}]
    model = page_model([Trace(steps, {}, {"label": "t"})])
    labels = dict(zip(model["rowIds"], model["rowLabels"]))
    assert all(len(label) <= ROW_LABEL_CHARS for label in labels.values())
    assert labels["r1"] == "r1" and labels["abcdefghij"] == "abcdefghij"  # fit: untouched
    shortened = [labels[rid] for rid in long_ids]
    assert all("\u2026" in label for label in shortened)
    assert len(set(shortened)) == len(long_ids)  # the tail tells them apart
    assert set(model["panels"][0]["rows"]) == set(ids)  # the data keeps the whole ids
    js = (Path(__file__).parents[2] / "tokenweir/timeline/static/timeline.js").read_text()
    assert "drawRowLabel(ctx, DATA.rowLabels[r], y)" in js and "ctx.clip()" in js
