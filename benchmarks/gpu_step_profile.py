"""Where a decode step's time goes, host and device: the instrument behind issue 33's speed work.

    python benchmarks/gpu_step_profile.py                     # CUDA, SmolLM2-135M shape
    python benchmarks/gpu_step_profile.py --device cpu --tiny  # a dry run (seconds)

For single-stream decode and for a batch of 64 decodes it prints:
* the wall time per engine step (median of the timed steps) and the device time per step;
* the host functions that take the step's time (cProfile, by own time): scheduler, input
  preparation, sampling, detokenisation, Python around the kernels;
* the device kernels by total time (torch.profiler), for the same steps.
A step whose wall time is far above its device time is host-bound: the cProfile table says
where. Random weights from the shipped config, as benchmarks/gpu_throughput.py builds them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_throughput as gt  # noqa: E402  (the model build and workload helpers)


def add_requests(engine, prompts: list[list[int]], max_tokens: int) -> None:
    from tokenweir import SamplingParams
    for prompt in prompts:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request, text = engine.make_request({"prompt_token_ids": prompt}, params)
        engine.add_request(request, text)


def decode_steps(engine, device: str, steps: int) -> list[float]:
    """Wall seconds of each of `steps` engine steps (synchronised after each), stepped as
    LLM.generate steps (outputs of finished requests only)."""
    times = []
    for _ in range(steps):
        gt.sync(device)
        t0 = time.perf_counter()
        engine.step(final_only=True)
        gt.sync(device)
        times.append(time.perf_counter() - t0)
    return times


def profile_case(llm, prompts: list[list[int]], device: str, steps: int, top: int) -> list[str]:
    engine = llm.llm_engine
    add_requests(engine, prompts, max_tokens=3 * steps + 8)
    while any(r.num_computed_tokens < len(r.prompt_token_ids)
              for r in engine.core.scheduler.running) or engine.core.scheduler.waiting:
        engine.step()  # the prefills, untimed
    decode_steps(engine, device, 4)  # graph capture / warm-up
    wall = decode_steps(engine, device, steps)
    prof = cProfile.Profile()
    prof.enable()
    decode_steps(engine, device, steps)
    prof.disable()
    graphs = getattr(engine.core.executor, "graphs", None)
    lines = [f"{len(prompts)} decodes per step: wall {statistics.median(wall) * 1e3:.3f} ms "
             f"per step (median of {steps}), {len(prompts) / statistics.median(wall):,.0f} tok/s;"
             f" CUDA graph replays so far: {getattr(graphs, 'replays', None)}"]
    lines += device_table(engine, device, steps, top)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    lines.append("host functions by own time (cProfile, %d steps):" % steps)
    lines += [ln for ln in text.getvalue().splitlines() if ln.strip()][4:]
    engine.abort_requests([r.request_id for r in list(engine.core.scheduler.running)])
    while engine.has_unfinished_requests():
        engine.step()
    return lines


def device_table(engine, device: str, steps: int, top: int) -> list[str]:
    if not device.startswith("cuda"):
        return []
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_steps(engine, device, steps)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    lines = [f"device time {total / steps / 1e3:.3f} ms per step; kernels by total time:"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        lines.append(f"  {e.self_device_time_total / steps:9.1f} us/step {e.count // steps:5d}"
                     f" calls/step  {e.key[:90]}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--dtype", default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--batches", default="1,64", help="decodes per step, comma-separated")
    args = p.parse_args(argv)
    import torch
    from tokenweir import LLM
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    plan = gt.plans(args.tiny)[0]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="tw-prof-") as folder:
        info = gt.build_model(plan, folder, args.device, getattr(torch, dtype_name), args.tiny)
        llm = LLM(model=folder, device=args.device, dtype=dtype_name, seed=0,
                  max_model_len=1024, max_num_seqs=max(batches),
                  kv_cache_space=gt.kv_space_gib(args, info))
        backend = getattr(llm.llm_engine.core.executor.attention_backend, "name", "cpu")
        print(f"{plan.name} ({'tiny' if args.tiny else 'full'}), {dtype_name} on "
              f"{args.device}, attention backend {backend}", flush=True)
        prompts = plan.workloads[0].prompts(info["vocab"])
        for batch in batches:
            group = [p[:64] for p in (prompts * batch)[:batch]]
            print("\n".join(profile_case(llm, group, args.device, args.steps, args.top)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
