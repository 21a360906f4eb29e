"""What each test file costs in a `make test` run (seconds of one xdist worker: the sum of its
tests' setup, call and teardown), and the order `--dist loadfile` hands files out in.

xdist's own order is by the number of tests in a file, so a file of one long test (test_fuzz,
test_vs_vidur, the README commands) went out last and ran alone at the end while the other
worker sat idle (a 15 s tail in a run of 317 s). Handed out longest first, the last files
are short ones and both workers end together (longest-processing-time-first). A file missing
here (new, or under 0.5 s) costs UNKNOWN_PER_TEST per test: it goes out after the measured ones.
Only the order depends on these figures, never what runs or its result; tests/test_file_costs.py
checks that every file named here exists.

Refresh: `python tests/file_costs.py LOG...` on the output of `pytest --durations=0` (one or
more runs; each file's mean) prints the table below.

Measured: two exclusive full runs of `make test`'s command (2 workers) on a 2-core AMD EPYC,
main 12e85ad, each file's mean."""

from __future__ import annotations

import collections
import re
import sys

UNKNOWN_PER_TEST = 0.05

FILE_COSTS = {
    "tests/engine/test_llm.py": 34.1,
    "tests/sim/test_sim_fidelity_repeats.py": 28.7,
    "tests/server/test_forkserver.py": 23.7,
    "tests/guided/test_guided_engine.py": 22.6,
    "tests/model/test_model_real.py": 21.2,
    "tests/server/test_server.py": 21.0,
    "tests/router/test_ray_points.py": 19.2,
    "tests/server/test_engine_process.py": 18.8,
    "tests/core/test_random_invariants.py": 18.0,
    "tests/server/test_fuzz.py": 17.3,
    "tests/engine/test_gpu_benchmark.py": 15.8,
    "tests/engine/test_batch_invariance.py": 15.6,
    "tests/server/test_robustness.py": 14.9,
    "tests/sim/test_vs_vidur.py": 14.4,
    "tests/model/test_triton_batch_invariant.py": 13.7,
    "tests/model/test_row_buckets.py": 13.6,
    "tests/server/test_start_gate.py": 13.4,
    "tests/router/test_ray_remote.py": 13.3,
    "tests/engine/test_slo_cut.py": 12.7,
    "tests/router/test_router.py": 11.7,
    "tests/cli/test_readme_commands.py": 10.9,
    "tests/guided/test_guided_server.py": 10.7,
    "tests/timeline/test_timeline_browser.py": 10.6,
    "tests/engine/test_validation.py": 10.0,
    "tests/core/test_random_prefix_swap.py": 9.1,
    "tests/cli/test_import_graph.py": 9.1,
    "tests/router/test_data_parallel.py": 8.1,
    "tests/model/test_attention_backends.py": 7.9,
    "tests/sim/test_decode_stretch.py": 7.7,
    "tests/parallel/test_tensor_parallel.py": 7.3,
    "tests/model/test_model_parity.py": 7.1,
    "tests/model/test_kernel_build_lock.py": 6.6,
    "tests/sim/test_sim_scale.py": 6.5,
    "tests/sim/test_calibrate_trace.py": 6.2,
    "tests/sim/test_cluster.py": 5.7,
    "tests/sim/test_golden_results.py": 5.6,
    "tests/server/test_server_start.py": 5.0,
    "tests/engine/test_preflight.py": 5.0,
    "tests/sim/test_slo_sim.py": 4.8,
    "tests/parallel/test_tp_failure.py": 4.5,
    "tests/sim/test_sim_fast_paths.py": 4.1,
    "tests/model/test_load_cache.py": 4.0,
    "tests/sim/test_studies.py": 3.9,
    "tests/engine/test_fault_isolation.py": 3.9,
    "tests/sim/test_window_fit.py": 3.8,
    "tests/model/test_sampler.py": 3.8,
    "tests/engine/test_fold_golden.py": 3.8,
    "tests/engine/test_attention_backend_engine.py": 3.7,
    "tests/sim/test_one_loop.py": 3.2,
    "tests/timeline/test_timeline_records.py": 2.6,
    "tests/sim/test_drift.py": 2.6,
    "tests/server/test_slo_reject_hopeless.py": 2.4,
    "tests/sim/test_sim_speed_digests.py": 2.3,
    "tests/guided/test_grammar.py": 2.3,
    "tests/sim/test_sim_engine.py": 2.1,
    "tests/sim/test_model_configs.py": 2.1,
    "tests/cli/test_generated_flags.py": 2.1,
    "tests/engine/test_preemption_modes.py": 1.9,
    "tests/core/test_high_water_mark.py": 1.8,
    "tests/benchmarks/test_slo_real.py": 1.7,
    "tests/server/test_tools_server.py": 1.7,
    "tests/engine/test_step_trace.py": 1.6,
    "tests/engine/test_llm_parallel_sampling.py": 1.4,
    "tests/model/test_skinny_linear.py": 1.3,
    "tests/sim/test_sim_setup.py": 1.3,
    "tests/router/test_replica_pages.py": 1.3,
    "tests/core/test_cramped_vs_roomy.py": 1.3,
    "tests/engine/test_penalties_engine.py": 1.2,
    "tests/sim/test_decode_hinge.py": 1.1,
    "tests/server/test_output_thread.py": 1.1,
    "tests/sim/test_sim_io.py": 1.0,
    "tests/model/test_triton_ops.py": 1.0,
    "tests/server/test_tiny_serve_model.py": 0.9,
    "tests/engine/test_fold_step.py": 0.8,
    "tests/cli/test_entry_point.py": 0.8,
    "tests/model/test_load_cache_prefetch.py": 0.7,
    "tests/sim/test_calibrate.py": 0.7,
    "tests/engine/test_startup_gc.py": 0.7,
    "tests/sim/test_forward_phases.py": 0.6,
    "tests/engine/test_offline_outputs.py": 0.6,
    "tests/core/test_cost_policy.py": 0.5,
    "tests/sim/test_sliding_window_pool.py": 0.5,
    "tests/cli/test_recorded_cli.py": 0.5,
    "tests/model/test_direct.py": 0.5,
}


def unit_cost(nodeids) -> float:
    """The cost of a unit of work (a file, or files scheduled together): its files' measured
    costs, or UNKNOWN_PER_TEST for each test of a file not measured."""
    per_file = collections.Counter(nodeid.split("::", 1)[0] for nodeid in nodeids)
    return sum(FILE_COSTS.get(path, UNKNOWN_PER_TEST * count) for path, count in per_file.items())


def longest_first(workqueue) -> list:
    """The (unit, nodeids) items of an xdist work queue, costliest first (ties: as they were)."""
    return sorted(workqueue.items(), key=lambda item: -unit_cost(item[1]))


def costs_from_logs(paths) -> dict:
    """Each file's mean seconds over the `--durations=0` logs at paths."""
    totals: collections.Counter = collections.Counter()
    line = re.compile(r"([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::")
    for path in paths:
        with open(path) as log:
            for match in filter(None, map(line.match, log)):
                totals[match.group(2)] += float(match.group(1))
    return {path: total / len(paths) for path, total in totals.items()}


if __name__ == "__main__":
    for path, cost in sorted(costs_from_logs(sys.argv[1:]).items(), key=lambda kv: -kv[1]):
        if cost >= 0.5:
            print(f'    "{path}": {cost:.1f},')
