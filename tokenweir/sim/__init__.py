"""Discrete-event simulator: the real Scheduler driven by a SimRunner on a virtual clock.

No torch anywhere in this package. One event loop (simulator.py, events in events.py) drives
one or more instances (instance.py: SimEngine + pipelining + KV import), each with its own
SimRunner (sim_runner.py); a single instance is a cluster of one. Entry points:
`build_simulation` (build.py, one instance) and `build_cluster` (cluster.py), workloads
(workload.py, sessions.py), latency models (latency.py), metrics and Chrome traces (metrics.py,
trace.py), and the `simulate` / `sweep` / `study` subcommands (cli.py).
"""
