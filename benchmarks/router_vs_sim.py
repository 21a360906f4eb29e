"""Sim vs real for routing: a shared-prefix workload (several system prompts, many users)
through 2 real `tokenweir serve` replicas behind `tokenweir router`, under round-robin and
under prefix-aware routing, and through the simulator's cluster of 2 instances with the step
times of a `tokenweir calibrate` profile of the same replicas. Prints, real beside simulated:
prefix-cache hit rate, TTFT p50/p90 and throughput, and prefix-aware's TTFT p50 gain over
round-robin (issue 37's target: the real gain within 10 points of the simulated one).

    tokenweir calibrate smollm2-135m --quick --threads 1 --out /tmp/smol1.json
    flock /tmp/cpu.lock python benchmarks/router_vs_sim.py --profile /tmp/smol1.json

Each replica runs one torch thread (2 replicas on 2 cores). The workload is the simulator's
own `synthetic` one (prefix groups); the real prompts are its token structure mapped into the
vocabulary, with each policy's prefixes made new so that no run reuses another's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from tokenweir.sim.cluster import build_cluster, summarize_cluster  # noqa: E402
from tokenweir.sim.metrics import percentile  # noqa: E402
from tokenweir.sim.workload import RequestSpec, synthetic  # noqa: E402

MODEL = "smollm2-135m"
POLICIES = ("round-robin", "prefix-aware")
ENGINE = {"max_model_len": 1024, "num_gpu_blocks_override": 256}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="a tokenweir calibrate profile (JSON)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s (Poisson)")
    p.add_argument("--groups", type=int, default=4, help="system prompts")
    p.add_argument("--prompt-len", type=int, default=448)
    p.add_argument("--prefix-len", type=int, default=384, help="tokens of the system prompt")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def workload(args: argparse.Namespace) -> list[RequestSpec]:
    return synthetic(args.num_requests, args.rate, seed=args.seed,
                     prompt=f"fixed:{args.prompt_len}", output=f"fixed:{args.output_len}",
                     num_prefix_groups=args.groups, prefix_len=args.prefix_len,
                     max_model_len=ENGINE["max_model_len"])


def real_prompt(spec: RequestSpec, run: int) -> list[int]:
    """The spec's token structure inside the vocabulary: a group's shared tokens, then a token
    unique to the request, then filler; `run` makes every group's prefix new."""
    shared = min(spec.prefix_len, spec.prompt_len - 1) if spec.prefix_group is not None else 0
    group = 1000 + 64 * run + (spec.prefix_group or 0)
    unique = 5000 + 1000 * run + spec.index
    return [group] * shared + [unique] + [300] * (spec.prompt_len - shared - 1)


# ---- real ----------------------------------------------------------------------------------
def start(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "NO_PROXY": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir", *args, "--port", str(port),
                             "--log-level", "warning"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} on {port} exited {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} did not come up")


async def one(http: httpx.AsyncClient, base: str, prompt: list[int], spec: RequestSpec,
              t0: float) -> tuple[float, float]:
    await asyncio.sleep(max(0.0, t0 + spec.arrival - time.perf_counter()))
    sent, first = time.perf_counter(), None
    body = {"prompt": prompt, "max_tokens": spec.output_len, "ignore_eos": True,
            "stream": True, "temperature": 0}
    async with http.stream("POST", base + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return first - sent, time.perf_counter() - t0


async def drive(base: str, specs: list[RequestSpec], run: int) -> tuple[list[float], float]:
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(http, base, real_prompt(s, run), s, t0)
                                      for s in specs))
    return [ttft for ttft, _ in done], max(end for _, end in done)


def prefix_counts(replicas: list[str]) -> tuple[float, float]:
    """Prefix-cache hit and query tokens summed over the replicas, read from each one (the
    router's merged /metrics leaves out a replica that is slow to answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"tokenweir:prefix_cache_hits_total": 0.0,
              "tokenweir:prefix_cache_queries_total": 0.0}
    for url in replicas:
        text = httpx.get(url + "/metrics", timeout=120, trust_env=False).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals["tokenweir:prefix_cache_hits_total"], \
        totals["tokenweir:prefix_cache_queries_total"]


def run_real(specs: list[RequestSpec], policy: str, run: int, replicas: list[str]) -> dict:
    port = 8600 + run
    args = ["router", "--routing-policy", policy, "--health-interval", "1"]
    for url in replicas:
        args += ["--replica", url]
    router = start(args, port)
    base = f"http://127.0.0.1:{port}"
    try:
        hits0, queries0 = prefix_counts(replicas)
        ttfts, span = asyncio.run(drive(base, specs, run))
        hits, queries = prefix_counts(replicas)
    finally:
        router.terminate()
        router.wait(30)
    ttfts.sort()
    return {"ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p90_ms": 1000 * percentile(ttfts, 90),
            "throughput": len(specs) / span,
            "prefix_hit_rate": (hits - hits0) / max(1.0, queries - queries0)}


# ---- simulated ---------------------------------------------------------------------------
def run_sim(specs: list[RequestSpec], policy: str, profile: str) -> dict:
    from tokenweir.sim.calibrate import load_profile
    from tokenweir.sim.latency import FittedLatencyModel

    model = FittedLatencyModel.from_profile(load_profile(profile))
    result = build_cluster(dict(ENGINE), specs, MODEL, "h100", num_instances=2, router=policy,
                           latency_model=model).run()
    overall = summarize_cluster(result)["overall"]
    return {"ttft_p50_ms": overall["ttft_p50_ms"], "ttft_p90_ms": overall["ttft_p90_ms"],
            "throughput": overall["request_throughput"],
            "prefix_hit_rate": overall["prefix_hit_rate"]}


def report(rows: dict) -> None:
    keys = ("prefix_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "throughput")
    print(f"{'policy':>14s} {'':>5s} " + " ".join(f"{k:>16s}" for k in keys))
    for policy in POLICIES:
        for kind in ("real", "sim"):
            m = rows[policy][kind]
            print(f"{policy:>14s} {kind:>5s} " + " ".join(f"{m[k]:16.3f}" for k in keys))
    for kind in ("real", "sim"):
        rr, pa = rows["round-robin"][kind], rows["prefix-aware"][kind]
        gain = 100 * (rr["ttft_p50_ms"] - pa["ttft_p50_ms"]) / rr["ttft_p50_ms"]
        print(f"prefix-aware TTFT p50 gain over round-robin, {kind}: {gain:+.1f}%")


def main() -> int:
    args = parse_args()
    specs = workload(args)
    replica_procs, urls = [], []
    try:
        for i in range(2):
            port = 8610 + i
            replica_procs.append(start(["serve", MODEL, "--dtype", "float32",
                                        "--max-model-len", str(ENGINE["max_model_len"]),
                                        "--num-gpu-blocks-override",
                                        str(ENGINE["num_gpu_blocks_override"])], port))
            urls.append(f"http://127.0.0.1:{port}")
        rows = {}
        for run, policy in enumerate(POLICIES):
            rows[policy] = {"real": run_real(specs, policy, run, urls),
                            "sim": run_sim(specs, policy, args.profile)}
    finally:
        for proc in replica_procs:
            proc.terminate()
            proc.wait(60)
    print(f"--- {len(specs)} requests at {args.rate}/s, {args.groups} system prompts of "
          f"{args.prefix_len} tokens in {args.prompt_len}-token prompts, "
          f"{args.output_len} output tokens; 2 replicas x 1 thread ---")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
