"""Discrete-event simulator: the real Scheduler driven by a SimRunner on a virtual clock.

No torch anywhere in this package. One event loop (simulator.py, events in events.py) drives
one or more instances (instance.py: SimEngine + pipelining + KV import), each with its own
SimRunner (sim_runner.py); a single instance is a cluster of one. Entry points:
`build_simulation` (build.py, one instance) and `build_cluster` (cluster.py), workloads
(workload.py, sessions.py), latency models (latency.py), model shapes and hardware profiles
(hardware.py; any model from a Hugging Face config.json and the shipped configs in models/:
model_config.py), metrics, Chrome traces and run digests (metrics.py, trace.py, digest.py),
and the `simulate` / `sweep` / `study` subcommands (cli.py).
"""
