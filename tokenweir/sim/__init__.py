"""Discrete-event simulator: the real Scheduler driven by a SimRunner on a virtual clock.

No torch anywhere in this package. Entry points: `Simulation` (simulator.py), workloads
(workload.py), latency models (latency.py), metrics and Chrome traces (metrics.py, trace.py),
and the `simulate` / `sweep` subcommands (cli.py).
"""
