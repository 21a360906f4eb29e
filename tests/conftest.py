"""Suite-wide settings: engines skip the start-up warm-up (one dummy step of the whole token
budget, ~1-3 s on SmolLM2-135M), since the suite builds hundreds of engines; the warm-up's own
tests turn it back on (tests/engine/test_warm_up.py). Child processes inherit it.

Under pytest-xdist (`make test` runs `-n 2`), each worker runs torch on its share of the cores
(cores // workers, at least 1): two workers of two threads each on two cores made OpenMP's
barriers wait on each other. Tests that set their own thread count still do."""

import os

os.environ.setdefault("TOKENWEIR_WARMUP", "0")


def _torch_threads_per_worker() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_torch_threads_per_worker()
