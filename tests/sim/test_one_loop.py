"""The simulator's one event loop: a single instance is a cluster of one, and every feature
(fitted profile, slo mid-step cuts, pipelining, sessions, PD) works in both modes.

The digests below were computed on the commit before the two loops became one (b2e2d84, its
two loops), by running this file there: `PYTHONPATH=. python tests/sim/test_one_loop.py`. They
cover what the golden CLI recordings (test_golden_results.py) do not reach: the Python API
paths (gaps as counts, gaps not recorded, gap end times), cuts with `check`, and a cluster
mixing PD, pp 2 and sessions.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from tokenweir.sim.build import build_simulation
from tokenweir.sim.cluster import build_cluster
from tokenweir.sim.counts import ValueCounts
from tokenweir.sim.sessions import synthetic_sessions
from tokenweir.sim.workload import RequestSpec, synthetic

SMALL = "smollm2-135m"
# Counters whose names predate this work (the stats object may gain fields).
STATS = ("num_steps", "num_preemptions", "recomputed_tokens", "generation_tokens",
         "num_swapped_out", "slo_cut_steps")


def _dump(r) -> str:
    """Everything a run decided, without wall-clock time."""
    itl = sorted(r.itl.counts.items()) if isinstance(r.itl, ValueCounts) else list(r.itl)
    return json.dumps([[dataclasses.asdict(x) for x in r.requests],
                       [dataclasses.asdict(s) for s in r.steps], itl,
                       {k: getattr(r.stats, k) for k in STATS}, r.end_time], sort_keys=True)


def _dump_cluster(result) -> str:
    return json.dumps([_dump(result.overall), [_dump(r) for r in result.instances],
                       result.routed, result.max_in_flight,
                       [dataclasses.asdict(t) for t in result.transfers]])


def _mixed(n: int, seed: int):
    return synthetic(n, 2000.0, seed=seed, prompt="lognormal:120:0.7", output="uniform:1:60",
                     arrival="gamma", cv=2.0, num_prefix_groups=3, prefix_len=64,
                     priority_mix="0:0.7,1:0.3", max_model_len=1024)


def _slo_specs():
    # a 4,000-token prompt (a ~14 s step on the CPU roofline), then an urgent short one
    return [RequestSpec("long", 0.0, 4000, 8, index=0),
            RequestSpec("urgent", 0.3, 200, 8, ttft_slo_ms=1000.0, index=1),
            RequestSpec("later", 0.5, 300, 8, ttft_slo_ms=20_000.0, index=2)]


SLO = dict(max_num_batched_tokens=4096, num_gpu_blocks_override=2000, max_model_len=8192,
           scheduling_policy="slo")


def cluster_pd_pp_sessions() -> str:
    sessions = synthetic_sessions(8, 30.0, seed=1, prompt="lognormal:150:0.5",
                                  output="uniform:2:30", turns="uniform:1:4",
                                  user_len="uniform:8:40", tool_delay_ms="lognormal:100:1",
                                  max_model_len=1024)
    cluster = build_cluster({"max_model_len": 1024, "num_gpu_blocks_override": 120},
                            _mixed(60, 1), SMALL, "h100", sessions=sessions, pd=(1, 2),
                            pp_size=2, router="prefix-aware", check=True)
    result = cluster.run()
    assert result.transfers and result.num_sessions == 8 and max(result.max_in_flight) == 2
    return _dump_cluster(result)


def single_slo_cut() -> str:
    result = build_simulation(SLO, _slo_specs(), SMALL, "cpu-epyc-2c", check=True).run()
    assert result.stats.slo_cut_steps == 1
    return _dump(result)


def single_itl_counts() -> str:
    specs = synthetic(600, 30.0, seed=0, prompt="lognormal:256:0.8",
                      output="lognormal:128:0.8", max_model_len=4096)
    return _dump(build_simulation({"max_num_seqs": 256, "max_num_batched_tokens": 2048}, specs,
                                  "llama-7b", "h100", itl_counts=True).run())


def single_swap_no_itl() -> str:
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 110,
              "max_num_batched_tokens": 256, "scheduler_reserve_full_isl": False,
              "preemption_mode": "swap", "swap_space": 0.01, "long_prefill_token_threshold": 64}
    result = build_simulation(engine, _mixed(150, 4), SMALL, "h100", record_itl=False,
                              check=True).run()
    assert result.stats.num_swapped_out > 0
    return _dump(result)


def cluster_pp4_itl_times() -> str:
    cluster = build_cluster({"max_model_len": 1024, "num_gpu_blocks_override": 200,
                             "max_num_batched_tokens": 256}, _mixed(120, 5), SMALL, "h100",
                            pp_size=4, num_instances=3, router="least-loaded",
                            record_itl_times=True)
    result = cluster.run()
    assert result.max_in_flight == [4, 4, 4]
    return _dump_cluster(result) + json.dumps(
        [[list(i.itl_times), i.itl_ids] for i in cluster.instances])


# single_itl_counts and single_swap_no_itl re-recorded for one intended change (session 10):
# the partial-prefill cap no longer counts a request whose prefill finishes in the step.
RECORDED_BEFORE_ONE_LOOP = {
    cluster_pd_pp_sessions: "26f7af338efb5c20e4b98392134b34f317586dce1d2cfe56a10f91841d42b355",
    single_slo_cut: "bbe1d5a3021d34f5c0d446af25f3085d3979da7ef85a678a35832d4c7e025047",
    single_itl_counts: "00765d0d503e9d11cc06b5d6359cc332408f67d92b3cba79f22cd434fb993edb",
    single_swap_no_itl: "084788576ce79fba6bd44ed0287bce128342132c62638368773b96d92d48bd64",
    cluster_pp4_itl_times: "d774d5f16e29053c47bd51a2ebef6b8b6c5a9f605fa1cd8d2cfcbd9f5e04b7e9",
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("run", list(RECORDED_BEFORE_ONE_LOOP), ids=lambda f: f.__name__)
def test_runs_are_identical_to_the_two_loop_simulator(run):
    assert _sha(run()) == RECORDED_BEFORE_ONE_LOOP[run]


# ---- every feature in both modes ------------------------------------------------------------
def _by_id(result):
    return {r.request_id: r for r in result.requests}


def test_a_mid_step_cut_happens_on_an_instance_of_a_two_instance_cluster():
    """Round-robin: 'long' and 'urgent' go to instance 0, 'other' to instance 1. The urgent
    arrival cuts instance 0's long prefill step; instance 1 has nothing to cut."""
    specs = [RequestSpec("long", 0.0, 4000, 8, index=0),
             RequestSpec("other", 0.1, 300, 8, ttft_slo_ms=20_000.0, index=1),
             RequestSpec("urgent", 0.3, 200, 8, ttft_slo_ms=1000.0, index=2)]

    def run(**kw):
        return build_cluster(dict(SLO, **kw), specs, SMALL, "cpu-epyc-2c", num_instances=2,
                             check=True).run()

    cut, plain = run(), run(slo_mid_step_cut=False)
    first, second = cut.instances
    assert set(_by_id(first)) == {"long", "urgent"} and set(_by_id(second)) == {"other"}
    assert first.stats.slo_cut_steps == 1 and second.stats.slo_cut_steps == 0
    assert first.stats.preemptions_by_cause["slo-mid-step"] == 1
    assert cut.overall.stats.slo_cut_steps == 1
    full = first.steps[0].seconds  # truncated at the layer boundary after 0.3 s (30 layers)
    assert 0.3 <= full < plain.instances[0].steps[0].seconds
    urgent = _by_id(cut.overall)["urgent"]
    assert urgent.first_token <= urgent.arrival + 1.0
    assert all(r.num_finishes == 1 and r.num_output == 8 for r in cut.overall.requests)
    # the probe: without cuts the same request waits for the long step
    assert plain.instances[0].stats.slo_cut_steps == 0
    late = _by_id(plain.overall)["urgent"]
    assert late.first_token > late.arrival + 1.0


def test_a_cut_in_a_cluster_of_one_is_the_single_instance_cut():
    single = build_simulation(SLO, _slo_specs(), SMALL, "cpu-epyc-2c", check=True).run()
    cluster = build_cluster(SLO, _slo_specs(), SMALL, "cpu-epyc-2c", check=True).run()
    assert single.stats.slo_cut_steps == 1
    assert _dump(single) == _dump(cluster.instances[0])


def test_slo_cuts_refuse_pipelining():
    with pytest.raises(ValueError, match="pipeline stage"):
        build_cluster(SLO, _slo_specs(), SMALL, "cpu-epyc-2c", pp_size=2)
    build_cluster(dict(SLO, slo_mid_step_cut=False), _slo_specs(), SMALL, "cpu-epyc-2c",
                  pp_size=2).run()


TRUE = {"const": 0.04, "prefill_tokens": 0.0025, "decode_rows": 0.004,
        "prefill_attention": 3e-6, "decode_context": 7e-6, "prefill_rows": 0.02,
        "multi_decode": 0.025}


def test_a_fitted_profile_drives_every_instance_of_a_cluster():
    from tokenweir.sim.latency import FittedLatencyModel

    model = FittedLatencyModel(TRUE, kv_bytes_per_token=4096, max_model_len=512)
    specs = [RequestSpec(f"r{i}", 1.0, 200, 4, index=i) for i in range(2)]
    cluster = build_cluster({"max_num_batched_tokens": 256, "enable_prefix_caching": False},
                            specs, num_instances=2, latency_model=model, check=True)
    result = cluster.run()
    assert result.routed == [1, 1]
    for inst, r in zip(cluster.instances, result.instances):
        assert inst.max_model_len == 512  # the profile's context length
        assert inst.kv.num_usable_blocks == 2**30 // (16 * 4096)  # sized as the real engine
        (record,) = r.requests
        assert record.first_token - record.arrival == pytest.approx(model.step_time([(200, 0)]))
        assert [s.seconds for s in r.steps[1:]] == pytest.approx(
            [model.step_time([(1, 200 + j)]) for j in range(3)])


def test_simulate_cli_takes_a_profile_in_cluster_mode(tmp_path, capsys):
    from tokenweir.cli import main as cli_main
    from tokenweir.sim.calibrate import PROFILE_FORMAT
    from tokenweir.sim.latency import FittedLatencyModel

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "coefficients": TRUE,
                                   "kv_bytes_per_token": 4096, "max_model_len": 512}))
    prefill = FittedLatencyModel(TRUE).step_time([(100, 0)])
    common = ["simulate", "--num-requests", "20", "--request-rate", "2", "--prompt-len",
              "fixed:100", "--output-len", "fixed:4", "--num-gpu-blocks-override", "300"]
    for layout in (["--num-instances", "2"], ["--pd", "1:1"], []):
        out = tmp_path / "m.json"
        assert cli_main(common + layout + ["--json", str(out), "--profile", str(profile)]) == 0
        metrics = json.loads(out.read_text())
        overall = metrics.get("overall", metrics)
        assert overall["num_finished"] == 20
        # the profile's step times, not the default roofline's (a few ms on an H100)
        assert overall["ttft_p50_ms"] >= prefill * 1000 * (1 - 1e-9)
        assert "fitted profile" in capsys.readouterr().out


def test_a_profile_caps_the_synthetic_workload_and_reaches_sweep(tmp_path, capsys):
    """The profile's context length (512) caps synthetic lengths (the default prompt mix has
    prompts beyond it: this run used to fail), and sweep points use the profile too."""
    import csv

    from tokenweir.cli import main as cli_main
    from tokenweir.sim.calibrate import PROFILE_FORMAT
    from tokenweir.sim.latency import FittedLatencyModel

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "coefficients": TRUE,
                                   "kv_bytes_per_token": 4096, "max_model_len": 512}))
    out, trace = tmp_path / "m.json", tmp_path / "w.jsonl"
    common = ["--num-requests", "60", "--request-rate", "5", "--num-gpu-blocks-override", "900",
              "--profile", str(profile)]
    assert cli_main(["simulate", *common, "--json", str(out), "--save-trace", str(trace)]) == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert max(x["prompt_len"] for x in lines) > 256  # the long tail is there, capped
    assert all(x["prompt_len"] + x["output_len"] <= 512 for x in lines)
    assert json.loads(out.read_text())["num_finished"] == 60
    sweep = tmp_path / "s.csv"
    assert cli_main(["sweep", *common, "--set", "max_num_batched_tokens=256,512",
                     "--jobs", "1", "--out", str(sweep)]) == 0
    rows = list(csv.DictReader(sweep.open()))
    prefill = FittedLatencyModel(TRUE).step_time([(1, 0)])  # the cheapest possible first step
    assert len(rows) == 2 and all(float(r["ttft_p50_ms"]) > prefill * 1000 for r in rows)
    capsys.readouterr()


def test_single_instance_mode_runs_pipelining_and_sessions():
    engine = {"max_model_len": 1024, "num_gpu_blocks_override": 200,
              "max_num_batched_tokens": 256}
    specs = [RequestSpec(f"d{i}", 0.0, 64, 40, index=i) for i in range(16)]
    single = build_simulation(engine, specs, SMALL, "h100", pp_size=2, check=True)
    result = single.run()
    assert single.instance.max_in_flight == 2  # two micro-batches really overlapped
    assert _dump(result) == _dump(build_cluster(engine, specs, SMALL, "h100", pp_size=2,
                                                check=True).run().instances[0])
    sessions = synthetic_sessions(4, 20.0, seed=2, prompt="fixed:200", output="fixed:20",
                                  turns="fixed:3", user_len="fixed:40",
                                  tool_delay_ms="fixed:250", max_model_len=1024)
    result = build_simulation(engine, [], SMALL, "h100", sessions=sessions, check=True).run()
    turns = _by_id(result)
    assert len(turns) == 12 and turns["s0.t2"].num_cached_tokens > 0  # later turns hit
    assert turns["s0.t1"].arrival == pytest.approx(turns["s0.t0"].finished + 0.25)
    assert _dump(result) == _dump(build_cluster(engine, [], SMALL, "h100", sessions=sessions,
                                                check=True).run().instances[0])


def test_pipeline_stages_hold_kv_in_both_modes():
    """Without an explicit pool size, pp stages add devices (and KV room) in single-instance
    mode exactly as in a cluster."""
    blocks = lambda sim: sim.scheduler.kv.num_usable_blocks
    flat = build_simulation({}, [], "llama-7b", "h100")
    deep = build_simulation({}, [], "llama-7b", "h100", pp_size=2)
    cluster = build_cluster({}, [], "llama-7b", "h100", pp_size=2, num_instances=2)
    assert blocks(deep) > 2 * blocks(flat)  # twice the memory, the weights counted once
    assert all(i.kv.num_usable_blocks == blocks(deep) for i in cluster.instances)


# ---- the loop's parts ------------------------------------------------------------------------
def test_events_order_by_time_then_kind_then_insertion():
    from tokenweir.sim.events import Arrival, EventKind, EventQueue, Wake

    queue = EventQueue()
    pushed = [(2.0, EventKind.WAKE, Wake("a")), (2.0, EventKind.ARRIVAL, Arrival(1)),
              (1.0, EventKind.WAKE, Wake("b")), (2.0, EventKind.ARRIVAL, Arrival(2)),
              (2.0, EventKind.STEP_END, Wake("c"))]
    for t, kind, event in pushed:
        queue.push(t, kind, event)
    order = []
    while queue:
        order.append(queue.pop()[2])
    assert order == [Wake("b"), Arrival(1), Arrival(2), Wake("c"), Wake("a")]


def test_the_runner_package_does_not_import_the_simulator():
    """runner/ holds the real model runner; the simulator's runner lives in sim/."""
    runner = Path(__file__).resolve().parents[2] / "tokenweir" / "runner"
    for path in runner.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("tokenweir.sim") for n in names), path.name
    assert (runner.parent / "sim" / "sim_runner.py").exists()


if __name__ == "__main__":
    for fn in RECORDED_BEFORE_ONE_LOOP:
        print(f"    {fn.__name__}: \"{_sha(fn())}\",")
    sys.exit(0)
