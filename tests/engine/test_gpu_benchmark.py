"""benchmarks/gpu_throughput.py's dry run (--device cpu --tiny): every code path (model build
from the shipped configs, word tokenizer, tokenweir and transformers runs, roofline, report)
runs here, so the script is not first executed on a lent GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forkserver  # tests/forkserver.py: the scripts start with torch already imported

ROOT = Path(__file__).resolve().parents[2]
# One torch thread, as the suite's servers run (and what the fork server preloaded torch with);
# the dry runs check code paths, not speed.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_gpu_benchmark_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    done = forkserver.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--device", "cpu",
         "--tiny", "--json", str(out)], env=ENV, timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["models"]) == {"smollm2-135m", "qwen3-0.6b"}
    small = results["models"]["smollm2-135m"]
    assert small["tokenweir"]["W4"]["output_tokens"] == 16  # 4 requests x 4 tokens, none cut
    assert small["transformers"]["W4"]["output_tokens"] == 16
    assert small["tokenweir"]["single_stream_tok_s"] > 0
    assert "roofline tok/s" in done.stdout and "nano-vllm's own figure" in done.stdout


def test_full_plans_construct():
    """The full (GPU) plans are built only on a GPU otherwise: a broken one (an argument
    passed twice, as once happened) would fail there first, after a device start."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_throughput
    names = [plan.name for plan in gpu_throughput.plans(tiny=False)]
    assert names == ["smollm2-135m", "qwen3-0.6b", "llama-3-8b"]
    assert gpu_throughput.plans(tiny=False)[2].cap_s == 30.0


def test_step_profile_dry_run():
    """benchmarks/gpu_step_profile.py on CPU with a tiny model: the per-step wall time and the
    host table for a single stream and a batch."""
    done = forkserver.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_step_profile.py"), "--device", "cpu",
         "--tiny", "--steps", "3", "--top", "5", "--batches", "1,4"], env=ENV,
        timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 decodes per step: wall" in done.stdout and "4 decodes per step" in done.stdout
    assert "host functions by own time" in done.stdout


def test_free_collects_what_was_dropped_then_freezes_the_survivors():
    """free() between runs: a dropped object in a reference cycle (a model's modules) is
    collected, and what survives is frozen, so the next pass does not walk the libraries
    imported so far again; while an exception is handled (its traceback may hold a model),
    nothing is frozen."""
    import gc
    import weakref

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_throughput

    class Node:
        pass

    dropped = Node()
    dropped.me = dropped
    gone = weakref.ref(dropped)
    del dropped
    frozen = gc.get_freeze_count()
    gpu_throughput.free("cpu")
    assert gone() is None
    assert gc.get_freeze_count() > frozen  # probe: the survivors were frozen
    kept = Node()
    kept.me = kept
    frozen = gc.get_freeze_count()
    try:
        raise RuntimeError("a failed run")
    except RuntimeError:
        gpu_throughput.free("cpu")
    assert gc.get_freeze_count() == frozen
