"""Sim vs real for routing: a shared-prefix workload (several system prompts, many users)
through 2 real `tokenweir serve` replicas behind `tokenweir router`, under round-robin and
under prefix-aware routing, and through the simulator's cluster of 2 instances calibrated for
the same replicas. Prints, real beside simulated: prefix-cache hit rate, TTFT p50/p90 and
throughput, and prefix-aware's TTFT p50 gain over round-robin (issue 37's target: the real
gain within 10 points of the simulated one); then where real and simulated part: requests
routed to each replica, the TTFT the replicas measured beside the client's (the difference is
the router's and HTTP's share), and the simulator's TTFT p50 with that share added.

    flock /tmp/cpu.lock python benchmarks/router_vs_sim.py            # profile from the runs' traces
    flock /tmp/cpu.lock python benchmarks/router_vs_sim.py --profile P.json   # and a calibrate grid's

Each replica runs one torch thread pinned to a core of its own (2 replicas on 2 cores; with a
core each, serve's --output-thread auto keeps outputs on the engine thread, so a replica never
runs two busy threads on another's core). The simulator's step times come from the replicas'
own step traces of these runs (`tokenweir calibrate --from-trace`: runner and engine overhead,
on this machine, at one thread, under whatever else ran beside them); the simulator gets the
same requests with the same arrival times. The workload is the simulator's own `synthetic`
one (prefix groups); the real prompts are its token structure mapped into the vocabulary,
with each policy's prefixes made new so that no run reuses another's cache.

Why these defaults (64 requests at 0.5/s, 12 system prompts of 384 tokens, 256-block pools):
round-robin sends every prompt to both replicas, and 12 prefixes (288 blocks) do not fit one
pool, so they evict one another; prefix-aware keeps ~6 per replica, which fit. The gain the
simulator then predicts barely moves with the machine's speed: +76.5/+78.8/+82.9/+81.2% with
a calibrate profile's step times x1/x1.5/x2/x3. The first smoke's workload (12 requests at
1.5/s, 4 prompts) predicted +52.5/+47.8/+8.6/+3.6% at the same speeds: on a shared machine,
whose speed moves between calibrating and running, its sim-vs-real gap said little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

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
    p.add_argument("--profile", help="also simulate with this tokenweir calibrate profile "
                   "(JSON) beside the one fitted to the runs' traces")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    p.add_argument("--groups", type=int, default=12, help="system prompts")
    p.add_argument("--prompt-len", type=int, default=448)
    p.add_argument("--prefix-len", type=int, default=384, help="tokens of the system prompt")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", help="keep the replicas' step traces and the profile fitted "
                   "to them (profile.json) in this folder (default: a temporary one)")
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
def start(args: list[str], port: int, core: Optional[int] = None) -> subprocess.Popen:
    """`tokenweir ARGS` on `port`, pinned to `core` when given, once /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "NO_PROXY": "127.0.0.1"}
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir", *args, "--port", str(port),
                             "--log-level", "warning"], env=env, cwd=ROOT, preexec_fn=pin,
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


COUNTERS = {"tokenweir:prefix_cache_hits_total": "hits",
            "tokenweir:prefix_cache_queries_total": "queries",
            "tokenweir:time_to_first_token_seconds_sum": "ttft_sum",
            "tokenweir:time_to_first_token_seconds_count": "ttft_count"}


def replica_counters(url: str) -> dict[str, float]:
    """Prefix-cache hit and query tokens and the TTFT histogram's sum and count, read from the
    replica itself (the router's merged /metrics leaves out a replica slow to answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = dict.fromkeys(COUNTERS.values(), 0.0)
    text = httpx.get(url + "/metrics", timeout=120, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                found[COUNTERS[sample.name]] += sample.value
    return found


def routed_per_replica(router: str, replicas: list[str]) -> list[int]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(router + "/metrics", timeout=120, trust_env=False).text
    routed = dict.fromkeys(replicas, 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenweir:router_routed_total":
                routed[sample.labels["replica"]] = int(sample.value)
    return [routed[url] for url in replicas]


async def idle_ttfts(base: str, count: int) -> list[float]:
    """TTFT of `count` requests sent one after another to `base` (the same short prompt: a
    prefix hit after the first), as the client sees it."""
    spec = RequestSpec("idle", 0.0, 64, 1)
    prompt = [7] * 64
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        return [(await one(http, base, prompt, spec, time.perf_counter()))[0]
                for _ in range(count)]


def router_latency(base: str, replica: str, count: int = 9) -> tuple[float, float]:
    """Median TTFT (ms) of an idle replica, straight and through the router: the router's own
    share of a request's TTFT (the replica's own HTTP handling is in both)."""
    straight = sorted(asyncio.run(idle_ttfts(replica, count)))
    routed = sorted(asyncio.run(idle_ttfts(base, count)))
    return 1000 * straight[count // 2], 1000 * routed[count // 2]


def run_real(specs: list[RequestSpec], policy: str, run: int, replicas: list[str]) -> dict:
    port = 8600 + run
    args = ["router", "--routing-policy", policy, "--health-interval", "1"]
    for url in replicas:
        args += ["--replica", url]
    router = start(args, port)
    base = f"http://127.0.0.1:{port}"
    try:
        before = [replica_counters(url) for url in replicas]
        ttfts, span = asyncio.run(drive(base, specs, run))
        after = [replica_counters(url) for url in replicas]
        routed = routed_per_replica(base, replicas)
        idle = router_latency(base, replicas[0]) if run == 0 else None
    finally:
        router.terminate()
        router.wait(30)
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in COUNTERS.values()}
    ttfts.sort()
    return {"ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p90_ms": 1000 * percentile(ttfts, 90),
            "throughput": len(specs) / span,
            "prefix_hit_rate": delta["hits"] / max(1.0, delta["queries"]),
            "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts),
            "replica_ttft_mean_ms": 1000 * delta["ttft_sum"] / max(1.0, delta["ttft_count"]),
            "routed": routed, "idle_ttft_ms": idle}


def start_replicas(trace_dir: str) -> tuple[list[subprocess.Popen], list[str]]:
    """Two replicas, each tracing its steps, each on a core of its own where there are two."""
    cores = sorted(os.sched_getaffinity(0))
    procs, urls = [], []
    for i in range(2):
        port = 8610 + i
        procs.append(start(["serve", MODEL, "--dtype", "float32",
                            "--max-model-len", str(ENGINE["max_model_len"]),
                            "--num-gpu-blocks-override", str(ENGINE["num_gpu_blocks_override"]),
                            "--trace", os.path.join(trace_dir, f"replica{i}.jsonl")], port,
                           core=cores[i] if len(cores) >= 2 else None))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def stop_replicas(procs: list[subprocess.Popen]) -> None:
    """SIGTERM: each drains, closes its engine and so finishes its trace."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(120)


# ---- simulated ---------------------------------------------------------------------------
def trace_profile(trace_dir: str) -> dict:
    from tokenweir.sim.calibrate_trace import calibrate_from_traces

    paths = [os.path.join(trace_dir, f"replica{i}.jsonl") for i in range(2)]
    return calibrate_from_traces(paths)


def run_sim(specs: list[RequestSpec], policy: str, profile) -> dict:
    from tokenweir.sim.latency import FittedLatencyModel

    model = FittedLatencyModel.from_profile(profile)
    result = build_cluster(dict(ENGINE), specs, MODEL, "h100", num_instances=2, router=policy,
                           latency_model=model).run()
    summary = summarize_cluster(result)
    overall = summary["overall"]
    return {"ttft_p50_ms": overall["ttft_p50_ms"], "ttft_p90_ms": overall["ttft_p90_ms"],
            "throughput": overall["request_throughput"],
            "prefix_hit_rate": overall["prefix_hit_rate"],
            "ttft_mean_ms": overall["ttft_mean_ms"],
            "routed": [m["routed"] for m in summary["instances"]]}


def report(rows: dict, kinds: tuple[str, ...]) -> None:
    keys = ("prefix_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "throughput")
    print(f"{'policy':>14s} {'':>9s} " + " ".join(f"{k:>16s}" for k in keys))
    for policy in POLICIES:
        for kind in kinds:
            m = rows[policy][kind]
            print(f"{policy:>14s} {kind:>9s} " + " ".join(f"{m[k]:16.3f}" for k in keys))
    for kind in kinds:
        print(f"prefix-aware TTFT p50 gain over round-robin, {kind}: "
              f"{gain(rows, kind, 'ttft_p50_ms'):+.1f}%")


def gain(rows: dict, kind: str, key: str, add_ms: tuple[float, float] = (0.0, 0.0)) -> float:
    rr = rows["round-robin"][kind][key] + add_ms[0]
    pa = rows["prefix-aware"][kind][key] + add_ms[1]
    return 100 * (rr - pa) / rr


def report_gap(rows: dict) -> None:
    """Where real and simulated part: routing, the router's and HTTP's share of TTFT."""
    print("--- where real and simulated part ---")
    share = []
    for policy in POLICIES:
        real, sim = rows[policy]["real"], rows[policy]["sim"]
        extra = real["ttft_mean_ms"] - real["replica_ttft_mean_ms"]
        share.append(extra)
        print(f"{policy:>14s}: routed per replica real {real['routed']} sim {sim['routed']}; "
              f"TTFT mean client {real['ttft_mean_ms']:.1f} ms, replicas "
              f"{real['replica_ttft_mean_ms']:.1f} ms (router + HTTP {extra:.1f} ms), "
              f"sim {sim['ttft_mean_ms']:.1f} ms")
    print(f"sim gain with the router + HTTP share added to its TTFT p50: "
          f"{gain(rows, 'sim', 'ttft_p50_ms', tuple(share)):+.1f}%")
    straight, routed = rows["round-robin"]["real"]["idle_ttft_ms"]
    print(f"idle replica, 64-token prompt (hit), 9 requests one at a time: TTFT median "
          f"{straight:.1f} ms straight, {routed:.1f} ms through the router "
          f"(the router's own share: {routed - straight:+.1f} ms)")


def main() -> int:
    args = parse_args()
    specs = workload(args)
    rows: dict = {policy: {} for policy in POLICIES}
    with tempfile.TemporaryDirectory(prefix="router_vs_sim.") as temporary:
        trace_dir = args.trace_dir or temporary
        os.makedirs(trace_dir, exist_ok=True)
        procs, urls = start_replicas(trace_dir)
        try:
            for run, policy in enumerate(POLICIES):
                rows[policy]["real"] = run_real(specs, policy, run, urls)
        finally:
            stop_replicas(procs)
        profile = trace_profile(trace_dir)
        with open(os.path.join(trace_dir, "profile.json"), "w") as f:
            json.dump(profile, f, indent=1)
    kinds = ("real", "sim")
    for policy in POLICIES:
        rows[policy]["sim"] = run_sim(specs, policy, profile)
        if args.profile:
            rows[policy]["sim-grid"] = run_sim(specs, policy, args.profile)
    kinds += ("sim-grid",) if args.profile else ()
    print(f"--- {len(specs)} requests at {args.rate}/s, {args.groups} system prompts of "
          f"{args.prefix_len} tokens in {args.prompt_len}-token prompts, "
          f"{args.output_len} output tokens; 2 replicas x 1 thread; sim: the replicas' "
          f"traces ({profile['num_steps']} steps, fit R^2 {profile['fit']['r2']:.3f})"
          + (f", sim-grid: {args.profile}" if args.profile else "") + " ---")
    report(rows, kinds)
    report_gap(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
