"""Run Vidur (microsoft/vidur) on a request trace and time its event loop.

Runs with the python of Vidur's own virtual environment, from Vidur's checkout as the working
directory (its table paths are relative): benchmarks/vs_vidur.py starts it as a subprocess and
never imports it. Nothing of Vidur is copied here: this file only builds Vidur's own config
objects and calls `Simulator.run()`.

    cd PEER && VENV/bin/python RUNNER SPEC.json OUT.json

SPEC.json (written by vs_vidur.py):
    trace_file        CSV with arrived_at, num_prefill_tokens, num_decode_tokens (seconds)
    num_replicas      replicas behind Vidur's round-robin global scheduler
    chunk_size        Sarathi (chunked prefill) token budget per batch
    batch_size_cap    most requests in a batch
    num_blocks        KV blocks per replica (block_size tokens each)
    block_size, model_name, device, network_device
    cache_dir         where Vidur keeps its trained predictors (trained once, then reused)
    dump_op_times     also write Vidur's predicted per-op times (ms) to OUT.json
    write_metrics     Vidur's metrics store records as the run goes (default true; false:
                      its hooks return at once; the request records are read either way)

OUT.json: setup_seconds (config, predictor training or cache load, trace), run_seconds
(`Simulator.run()` alone, wall), cpu_seconds (process CPU time of the run), end_time, and
per request: arrival, first_token (prefill completed), finished, num_output.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import time

os.environ.setdefault("WANDB_MODE", "disabled")

from vidur.config import (  # noqa: E402
    ClusterConfig,
    MetricsConfig,
    RandomForrestExecutionTimePredictorConfig,
    ReplicaConfig,
    RoundRobinGlobalSchedulerConfig,
    SarathiSchedulerConfig,
    SimulationConfig,
    TraceRequestGeneratorConfig,
)
from vidur.events import RequestArrivalEvent  # noqa: E402
from vidur.simulator import Simulator  # noqa: E402
from vidur.utils.random import set_seeds  # noqa: E402

# Vidur's default predictor is a random forest chosen by a 27-point grid search with 10-fold
# cross-validation per operation: hours on two shared cores. One grid point (Vidur's middle
# values) and 2 folds keep the same estimator family; the fit is cached in cache_dir.
PREDICTOR_GRID = {"num_estimators": [250], "max_depth": [16], "min_samples_split": [2],
                  "k_fold_cv_splits": 2, "num_training_job_threads": 1}


def simulation_config(spec: dict, output_dir: str) -> SimulationConfig:
    replica = ReplicaConfig(model_name=spec["model_name"], device=spec["device"],
                            network_device=spec["network_device"])
    scheduler = SarathiSchedulerConfig(chunk_size=spec["chunk_size"],
                                       batch_size_cap=spec["batch_size_cap"],
                                       block_size=spec["block_size"],
                                       num_blocks=spec["num_blocks"])
    cluster = ClusterConfig(num_replicas=spec["num_replicas"], replica_config=replica,
                            global_scheduler_config=RoundRobinGlobalSchedulerConfig(),
                            replica_scheduler_config=scheduler)
    generator = TraceRequestGeneratorConfig(trace_file=spec["trace_file"],
                                            max_tokens=spec["max_tokens"])
    predictor = RandomForrestExecutionTimePredictorConfig(
        prediction_max_batch_size=spec["batch_size_cap"],
        prediction_max_tokens_per_request=spec["max_tokens"], **PREDICTOR_GRID)
    metrics = MetricsConfig(write_metrics=spec.get("write_metrics", True), store_plots=False,
                            enable_chrome_trace=False,
                            output_dir=output_dir, cache_dir=spec["cache_dir"])
    return SimulationConfig(log_level="warning", cluster_config=cluster,
                            request_generator_config=generator,
                            execution_time_predictor_config=predictor, metrics_config=metrics)


def queued_requests(sim: Simulator) -> list:
    """The requests the simulator generated, in arrival order (read before it runs)."""
    arrivals = [event for _, event in sim._event_queue if isinstance(event, RequestArrivalEvent)]
    return [event._request for event in sorted(arrivals, key=lambda e: e._time)]


def op_times(sim: Simulator) -> dict:
    """Vidur's predicted per-layer op times (ms) as the first replica's predictor holds them:
    per token count 1..max_tokens for the linear ops, and the two attention grids."""
    replica_scheduler = next(iter(sim.scheduler._replica_schedulers.values()))
    predictor = replica_scheduler._replica_stage_schedulers[0]._execution_time_predictor
    predictions = predictor._predictions
    linear_ops = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act",
                  "attn_rope", "attn_kv_cache_save", "input_layernorm",
                  "post_attention_layernorm", "add")
    out = {"num_layers": predictor._num_layers_per_pipeline_stage,
           "kv_granularity": predictor._config.kv_cache_prediction_granularity, "linear": {}}
    for name in linear_ops:
        table = predictions[name]
        out["linear"][name] = [float(table[(n,)]) for n in range(1, len(table) + 1)]
    out["attn_decode"] = [[int(b), int(kv), float(v)]
                          for (b, kv), v in predictions["attn_decode"].items()]
    out["attn_prefill"] = [[int(kv), int(sq), float(v)]
                           for (kv, sq), v in predictions["attn_prefill"].items()]
    return out


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    setup_started = time.perf_counter()
    set_seeds(spec.get("seed", 42))
    config = simulation_config(spec, os.path.join(spec["cache_dir"], "..", "vidur_output"))
    sim = Simulator(config)
    atexit.unregister(sim._write_output)  # its plots and CSVs are not what is measured
    requests = queued_requests(sim)
    setup_seconds = time.perf_counter() - setup_started
    started, cpu_started = time.perf_counter(), time.process_time()
    sim.run()
    run_seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    out = {"setup_seconds": setup_seconds, "run_seconds": run_seconds,
           "cpu_seconds": cpu_seconds, "end_time": float(sim._time),
           "requests": [{"arrival": float(r.arrived_at),
                         "first_token": float(r._prefill_completed_at) if r.completed else None,
                         "finished": float(r._completed_at) if r.completed else None,
                         "num_output": int(r.num_decode_tokens),
                         "restarts": int(r.num_restarts)}
                        for r in requests]}
    if spec.get("dump_op_times"):
        out["op_times"] = op_times(sim)
    with open(out_path, "w") as f:
        json.dump(out, f)
    # Vidur made a timestamped folder holding only its config.json: nothing was written there
    shutil.rmtree(config.metrics_config.output_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
