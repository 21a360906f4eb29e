"""Cluster simulation: routers, pipeline depth, prefill/decode disaggregation, agentic sessions,
determinism, and the simulate CLI's cluster flags. Each behaviour is paired with a probe that
it really happened."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenweir.cli import main as cli_main
from tokenweir.sim.build import build_simulation
from tokenweir.sim.cluster import build_cluster, cluster_result_json, summarize_cluster
from tokenweir.sim.hardware import get_hardware, get_shape
from tokenweir.sim.latency import RooflineLatencyModel
from tokenweir.sim.sessions import synthetic_sessions
from tokenweir.sim.workload import RequestSpec, synthetic

SMALL = "smollm2-135m"
BASE = {"max_model_len": 1024, "num_gpu_blocks_override": 400}


def _cluster(specs, sessions=None, **kw):
    engine = {**BASE, **kw.pop("engine", {})}
    return build_cluster(engine, specs, SMALL, "h100", sessions=sessions, check=True, **kw)


def _cli(argv: list[str]) -> int:
    return cli_main(argv)


def _mixed(n: int = 120, seed: int = 3):
    return synthetic(n, 2000.0, seed=seed, prompt="lognormal:120:0.7", output="uniform:1:60",
                     arrival="gamma", cv=2.0, num_prefix_groups=3, prefix_len=64,
                     priority_mix="0:0.7,1:0.3", max_model_len=1024)


def test_one_instance_reproduces_the_single_instance_simulator_exactly():
    specs = _mixed()
    engine = {**BASE, "num_gpu_blocks_override": 100, "max_num_batched_tokens": 256,
              "scheduler_reserve_full_isl": False}
    single = build_simulation(engine, specs, SMALL, "h100", check=True).run()
    cluster = build_cluster(engine, specs, SMALL, "h100", check=True).run()
    (inst,) = cluster.instances
    dump = lambda r: json.dumps([[dataclasses.asdict(x) for x in r.requests],
                                 [dataclasses.asdict(s) for s in r.steps], list(r.itl),
                                 dataclasses.asdict(r.stats), r.end_time], sort_keys=True)
    assert single.stats.num_preemptions > 0  # the comparison covers preemption
    assert dump(single) == dump(inst)
    assert [dataclasses.asdict(r) for r in cluster.overall.requests] == \
        [dataclasses.asdict(r) for r in single.requests]


def test_one_instance_steps_again_after_a_step_that_only_preempted_as_the_simulator_does():
    """Auto preemption with cost victims on a cramped pool: some steps only preempt (their
    requester is its own victim). The instance must step again at once, as Simulation does
    (they share SimEngine); the cluster loop used to idle and stalled on this workload. The
    first 40 of its 400 requests (the last arriving at 0.140 s): the preempt-only step comes
    at 0.178 s with these as with all 400 (833 steps instead of 2,869), and no arrival follows
    it to wake an idling instance, so an instance that does not step again stalls."""
    specs = synthetic(400, 300.0, seed=2, prompt="lognormal:120:0.9", output="lognormal:40:0.9",
                      arrival="gamma", cv=2.0, num_prefix_groups=4, prefix_len=64,
                      priority_mix="0:0.7,1:0.3", max_model_len=1024)[:40]
    assert max(s.arrival for s in specs) < 0.178
    engine = {"max_model_len": 1024, "max_num_batched_tokens": 256,
              "num_gpu_blocks_override": 120, "scheduler_reserve_full_isl": False,
              "preemption_mode": "auto", "preemption_policy": "cost", "swap_space": 0.01}
    single = build_simulation(engine, specs, SMALL, "h100", check=True).run()
    cluster = build_cluster(engine, specs, SMALL, "h100", check=True)
    (inst,) = cluster.instances
    start_step, preempt_only = inst.start_step, []

    def spy(now):
        step = start_step(now)
        if step is None and inst.step_again:
            preempt_only.append(now)
        return step

    inst.start_step = spy
    result = cluster.run()
    assert preempt_only  # the case really happened
    assert all(r.num_finishes == 1 for r in result.overall.requests)
    dump = lambda r: json.dumps([[dataclasses.asdict(x) for x in r.requests],
                                 [dataclasses.asdict(s) for s in r.steps], list(r.itl),
                                 dataclasses.asdict(r.stats), r.end_time], sort_keys=True)
    assert dump(single) == dump(result.instances[0])


def test_round_robin_sends_the_ith_request_to_instance_i_mod_n():
    specs = synthetic(30, 50.0, seed=1, prompt="fixed:64", output="fixed:5")
    result = _cluster(specs, num_instances=3, router="round-robin").run()
    assert result.routed == [10, 10, 10]
    order = sorted(specs, key=lambda s: (s.arrival, s.index))
    for k, spec in enumerate(order):
        assert spec.request_id in {r.request_id for r in result.instances[k % 3].requests}


def test_least_loaded_avoids_the_instance_busy_with_a_long_request():
    specs = [RequestSpec("long", 0.0, 64, 400, index=0)] + [
        RequestSpec(f"s{i}", 0.001 + 0.01 * i, 64, 2, index=i + 1) for i in range(9)]
    least = _cluster(specs, num_instances=2, router="least-loaded").run()
    robin = _cluster(specs, num_instances=2, router="round-robin").run()
    assert least.routed == [1, 9]  # every short one went to the idle instance
    assert robin.routed == [5, 5]  # the probe: round-robin does not look at load
    assert {r.request_id for r in least.instances[0].requests} == {"long"}


def test_prefix_aware_routing_keeps_each_prefix_group_on_one_instance():
    specs = synthetic(80, 40.0, seed=5, prompt="fixed:300", output="fixed:4",
                      num_prefix_groups=4, prefix_len=256)
    aware = _cluster(specs, num_instances=4, router="prefix-aware").run()
    robin = _cluster(specs, num_instances=4, router="round-robin").run()
    group = {s.request_id: s.prefix_group for s in specs}
    groups_per_instance = [{group[r.request_id] for r in inst.requests}
                           for inst in aware.instances]
    assert all(len(g) == 1 for g in groups_per_instance if g)
    assert sum(1 for g in groups_per_instance if g) >= 2  # it still spreads the groups
    hit = lambda res: summarize_cluster(res)["overall"]["prefix_hit_rate"]
    assert hit(aware) > hit(robin) > 0


def _overlap(steps) -> int:
    """Most batches whose [start, start + seconds) intervals overlap at once."""
    edges = sorted([(s.start, 1) for s in steps] + [(s.start + s.seconds, -1) for s in steps],
                   key=lambda e: (e[0], e[1]))
    depth = most = 0
    for _, d in edges:
        depth += d
        most = max(most, depth)
    return most


def test_pipeline_depth_bounds_batches_in_flight():
    specs = [RequestSpec(f"d{i}", 0.0, 64, 40, index=i) for i in range(16)]
    # the budget is per micro-batch: 4 prompts of 64 fill one, so 16 spread over 4 batches
    engine = {"max_num_batched_tokens": 256}
    deep = _cluster(specs, pp_size=4, engine=engine).run()
    flat = _cluster(specs, pp_size=1, engine=engine).run()
    assert deep.max_in_flight == [4] and flat.max_in_flight == [1]
    assert _overlap(deep.instances[0].steps) == 4  # probe from the step intervals themselves
    assert _overlap(flat.instances[0].steps) == 1
    two = _cluster(specs, pp_size=2, engine=engine).run()
    assert two.max_in_flight == [2] and _overlap(two.instances[0].steps) == 2
    assert all(r.num_finishes == 1 and r.num_output == 40 for r in deep.overall.requests)
    # a batch takes its whole step time; the next one enters when stage 0 frees (a quarter)
    first, second = deep.instances[0].steps[:2]
    assert first.start == 0.0 and second.start == pytest.approx(first.seconds / 4)
    assert second.num_reqs == 4 and first.num_reqs == 4


def test_pd_transfer_delay_appears_in_ttft():
    prompt = 700
    model = RooflineLatencyModel(get_shape(SMALL), get_hardware("h100"))
    spec = [RequestSpec("only", 1.0, prompt, 5)]
    plain = _cluster(spec, num_instances=2).run()
    gbps = 10.0
    pd = build_cluster(BASE, spec, SMALL, "h100", pd=(1, 1), link_gbps=gbps, check=True,
                       latency_model=model).run()
    (transfer,) = pd.transfers
    full = (prompt - 1) // 16 * 16  # the prompt's full blocks cross the link
    assert transfer.num_bytes == full * get_shape(SMALL).kv_bytes_per_token(2)
    delay = transfer.num_bytes / (gbps * 1e9 / 8)
    assert transfer.done - transfer.ready == pytest.approx(delay)
    ttft = lambda r: r.overall.requests[0].first_token - r.overall.requests[0].arrival
    assert ttft(plain) == pytest.approx(model.step_time([(prompt, 0)]))
    # prefill, transfer, then the decode instance computes only the last partial block
    assert ttft(pd) == pytest.approx(model.step_time([(prompt, 0)]) + delay
                                     + model.step_time([(prompt - full, full)]))
    assert pd.routed == [1, 1] and pd.instances[1].requests[0].num_cached_tokens == full
    assert pd.overall.requests[0].num_output == 5
    slow = build_cluster(BASE, spec, SMALL, "h100", pd=(1, 1), link_gbps=1.0).run()
    assert ttft(slow) > ttft(pd) + 0.9 * delay * 9


def test_pd_conserves_requests_under_load():
    specs = _mixed(150)
    result = _cluster(specs, pd=(2, 2), router="least-loaded",
                      engine={"num_gpu_blocks_override": 150}).run()
    assert len(result.transfers) == 150
    assert all(r.num_finishes == 1 for r in result.overall.requests)
    by_id = {s.request_id: s for s in specs}
    assert all(r.num_output == by_id[r.request_id].output_len for r in result.overall.requests)
    for i in (0, 1):  # prefill instances: one token each, pinned blocks all released
        inst = result.instances[i]
        assert all(r.num_output == 1 for r in inst.requests)


def test_session_turns_reuse_the_previous_turn_through_the_prefix_cache():
    sessions = synthetic_sessions(6, 20.0, seed=2, prompt="fixed:200", output="fixed:20",
                                  turns="fixed:3", user_len="fixed:40",
                                  tool_delay_ms="fixed:250", max_model_len=1024)
    result = _cluster([], sessions, num_instances=2, router="prefix-aware").run()
    records = {r.request_id: r for r in result.overall.requests}
    assert len(records) == 18 and result.num_sessions == 6
    for s in sessions:
        first, second, third = (records[s.request_id(k)] for k in range(3))
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens > 0 and third.num_cached_tokens > second.num_cached_tokens
        assert second.prompt_len == 200 + 20 + 40 and third.prompt_len == 260 + 20 + 40
        assert second.arrival == pytest.approx(first.finished + 0.25)
        assert third.arrival == pytest.approx(second.finished + 0.25)
    assert summarize_cluster(result)["overall"]["prefix_hit_rate"] > 0.5


def test_cluster_runs_are_byte_identical_and_seeded():
    def once(seed):
        sessions = synthetic_sessions(8, 30.0, seed=seed, prompt="lognormal:150:0.5",
                                      output="uniform:2:30", turns="uniform:1:4",
                                      user_len="uniform:8:40", tool_delay_ms="lognormal:100:1",
                                      max_model_len=1024)
        specs = _mixed(60, seed=seed)
        return cluster_result_json(_cluster(specs, sessions, pd=(1, 2), pp_size=2,
                                            router="prefix-aware",
                                            engine={"num_gpu_blocks_override": 120}).run())
    assert once(1) == once(1)
    assert once(1) != once(2)


def test_simulate_cli_cluster_flags_write_per_instance_json(tmp_path, capsys):
    out = tmp_path / "m.json"
    common = ["simulate", "--model-shape", SMALL, "--num-requests", "40", "--request-rate",
              "200", "--prompt-len", "fixed:200", "--output-len", "fixed:8",
              "--num-gpu-blocks-override", "300", "--max-model-len", "512"]
    assert _cli(common + ["--pd", "1:2", "--link-gbps", "25", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert [m["role"] for m in metrics["instances"]] == ["prefill", "decode", "decode"]
    assert metrics["overall"]["kv_transfers"] == 40 and metrics["overall"]["num_finished"] == 40
    assert "per instance" in capsys.readouterr().out
    assert _cli(common + ["--sessions", "5", "--turns", "fixed:2", "--num-instances", "2",
                          "--router", "prefix-aware", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["overall"]["num_finished"] == 10
    assert _cli(common + ["--pd", "2"]) == 2
    assert "bad --pd" in capsys.readouterr().err


def test_prioritize_prefill_is_reachable_from_the_simulate_cli(tmp_path):
    def ttft_p50(*flags):
        out = tmp_path / "p.json"
        assert _cli(["simulate", "--model-shape", SMALL, "--num-requests", "80",
                     "--request-rate", "400", "--prompt-len", "fixed:96", "--output-len",
                     "fixed:40", "--max-num-batched-tokens", "128",
                     "--num-gpu-blocks-override", "600", "--max-model-len", "512",
                     *flags, "--json", str(out)]) == 0
        metrics = json.loads(out.read_text())
        return metrics.get("overall", metrics)["ttft_p50_ms"]
    # prefills first: new prompts no longer wait behind the running decodes
    assert ttft_p50("--prioritize-prefill") < ttft_p50("--no-prioritize-prefill")
    busy = ("--num-instances", "2", "--request-rate", "2000")  # the cluster path too
    assert ttft_p50("--prioritize-prefill", *busy) < ttft_p50("--no-prioritize-prefill", *busy)


def _trace_by_pid(events):
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    steps, spans, transfers = {}, {}, {}
    for e in events:
        if e["ph"] == "X" and e.get("cat") == "step":
            steps[e["pid"]] = steps.get(e["pid"], 0) + 1
        elif e["ph"] == "X" and e.get("cat") == "kv_transfer":
            transfers[e["pid"]] = transfers.get(e["pid"], 0) + 1
        elif e["ph"] in "be" and e.get("cat") == "request":
            spans.setdefault((e["pid"], e["id"]), []).append(e["ph"])
    return names, steps, spans, transfers


def test_cluster_chrome_trace_has_one_process_per_instance():
    from tokenweir.sim.trace import cluster_chrome_trace_events

    specs = _mixed(80)
    result = _cluster(specs, pd=(1, 2), router="least-loaded",
                      engine={"num_gpu_blocks_override": 200}).run()
    names, steps, spans, transfers = _trace_by_pid(cluster_chrome_trace_events(result))
    assert names == {1: "instance 0 (prefill)", 2: "instance 1 (decode)",
                     3: "instance 2 (decode)"}
    # every instance really ran: its own steps, on its own process
    assert steps == {i + 1: len(inst.steps) for i, inst in enumerate(result.instances)}
    assert all(n > 0 for n in steps.values())
    for pid in (1, 2, 3):  # a request span (and its 3 phases) per request the instance served
        ids = {key[1] for key in spans if key[0] == pid}
        assert len(ids) == len(result.instances[pid - 1].requests)
    assert all(phases.count("b") == phases.count("e") == 4 for phases in spans.values())
    # a request served by the prefill and a decode instance is two spans, ids never clash
    assert len({key[1] for key in spans}) == len(spans) == 2 * len(specs)
    assert sum(transfers.values()) == len(result.transfers) == len(specs)
    assert set(transfers) <= {2, 3}  # on the receiving (decode) instances


def test_simulate_cli_cluster_chrome_trace(tmp_path):
    trace = tmp_path / "t.json"
    assert _cli(["simulate", "--model-shape", SMALL, "--num-requests", "30", "--request-rate",
                 "100", "--prompt-len", "fixed:100", "--output-len", "fixed:6",
                 "--num-gpu-blocks-override", "300", "--max-model-len", "512",
                 "--num-instances", "2", "--chrome-trace", str(trace)]) == 0
    names, steps, spans, _ = _trace_by_pid(json.loads(trace.read_text())["traceEvents"])
    assert names == {1: "instance 0 (mixed)", 2: "instance 1 (mixed)"}
    assert steps[1] > 0 and steps[2] > 0
    assert len(spans) == 30 and {pid for pid, _ in spans} == {1, 2}


def test_a_cluster_run_makes_no_reference_cycles_so_pausing_the_collector_leaks_nothing():
    """Cluster.run pauses the cyclic GC; safe only if the loop leaves no cycles. PD hand-offs,
    sessions, pipelining and swap preemption exercise every path."""
    import gc

    sessions = synthetic_sessions(6, 30.0, seed=3, prompt="lognormal:150:0.5",
                                  output="uniform:2:30", turns="uniform:1:4",
                                  user_len="uniform:8:40", tool_delay_ms="lognormal:100:1",
                                  max_model_len=1024)
    cluster = _cluster(_mixed(80), sessions, pd=(1, 2), pp_size=2, router="prefix-aware",
                       engine={"num_gpu_blocks_override": 120, "preemption_mode": "swap",
                               "swap_space": 0.01})
    gc.collect()
    assert gc.isenabled()
    result = cluster.run()
    assert gc.isenabled()  # restored
    assert result.overall.stats.num_preemptions > 0 and result.transfers
    assert gc.collect() == 0
