"""Tensor parallelism: Megatron-style sharding (sharding.py), the per-rank runner
(tp_runner.py), the collective cut vote (vote.py), and the multi-process executor in which this
process is rank 0 (executor.py, worker.py)."""
