"""tokenweir serve vs a peer server (llama.cpp's llama-server), same seeded workload, same run.

    python benchmarks/serve_vs_peer.py --model smollm2-135m \
        [--peer-cmd "llama-server -m model.gguf --port 8091" | --peer-url http://127.0.0.1:8091] \
        [--peer-model NAME] [--num-prompts 64 --request-rate inf --max-concurrency 16]

Starts `tokenweir serve` on a free port, runs `tokenweir bench serve` against it, then against
the peer (started from --peer-cmd, or already running at --peer-url; skipped with a message if
neither is given), and prints both sides and the tokenweir/peer ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenweir.bench.serve import add_args, print_report, run_benchmark

KEYS = ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
        "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def bench(args: argparse.Namespace, base_url: str, model: str) -> dict:
    ns = argparse.Namespace(**vars(args))
    ns.base_url, ns.model = base_url, model
    result = asyncio.run(run_benchmark(ns))
    print_report(result, args.percentiles)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser, require_target=False)
    parser.set_defaults(base_url="", model="smollm2-135m")
    parser.add_argument("--serve-args", default="--dtype float32 --max-model-len 2048",
                        help="extra flags for tokenweir serve")
    parser.add_argument("--peer-cmd", default=None, help="command that starts the peer server")
    parser.add_argument("--peer-url", default=None, help="a peer already running here")
    parser.add_argument("--peer-model", default=None, help="model name the peer expects")
    args = parser.parse_args()

    port = free_port()
    cmd = [sys.executable, "-m", "tokenweir.server.cli", "serve", args.model, "--port",
           str(port), "--log-level", "warning", *shlex.split(args.serve_args)]
    proc = subprocess.Popen(cmd, env={**os.environ})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, proc)
        print(f"\n### tokenweir ({url})")
        ours = bench(args, url, args.model)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    peer_proc = None
    peer_url = args.peer_url
    if args.peer_cmd:
        peer_proc = subprocess.Popen(shlex.split(args.peer_cmd))
        peer_url = peer_url or "http://127.0.0.1:8080"
    if not peer_url:
        print("\nno peer: pass --peer-cmd 'llama-server -m MODEL.gguf --port P' with "
              "--peer-url http://127.0.0.1:P, or --peer-url of a running server; "
              "peer comparison skipped")
        return 0
    try:
        wait_up(peer_url.rstrip("/"), peer_proc)
        print(f"\n### peer ({peer_url})")
        theirs = bench(args, peer_url, args.peer_model or args.model)
    finally:
        if peer_proc is not None:
            peer_proc.terminate()
            peer_proc.wait(timeout=60)
    print(f"\n{'metric':<28}{'tokenweir':>12}{'peer':>12}{'ratio':>10}")
    for key in KEYS:
        a, b = ours[key], theirs[key]
        ratio = a / b if b else float("nan")
        print(f"{key:<28}{a:>12.2f}{b:>12.2f}{ratio:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
