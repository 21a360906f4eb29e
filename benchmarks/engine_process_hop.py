"""What the engine process's hop costs a served request: `tokenweir serve` with the engine core
in-process and in a process of its own (--engine-process, engine/core_client.py), each loaded by
`tokenweir bench serve` at a few concurrencies, interleaved (in, out, out, in, ...).

Usage: python benchmarks/engine_process_hop.py [--concurrency 1 4 16] [--num-prompts 24]
           [--input-len 128] [--output-len 64] [--rounds 1]
Prints one line per run: mode, concurrency, output tokens/s, median TTFT and TPOT (ms).
The servers use the load cache in $TOKENWEIR_CACHE_DIR (default: the user's), warm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"in-process": "--no-engine-process", "engine-process": "--engine-process"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, model: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "NO_PROXY": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir", "serve", model, "--port",
                             str(port), "--log-level", "warning", MODES[mode]], env=env)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve ({mode}) exited with status {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def load(base: str, model: str, concurrency: int, args: argparse.Namespace) -> dict:
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([sys.executable, "-m", "tokenweir", "bench", "serve", "--base-url", base,
                    "--model", model, "--num-prompts", str(args.num_prompts), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len),
                    "--max-concurrency", str(concurrency), "--save-result", out,
                    "--no-progress"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": ROOT, "NO_PROXY": "127.0.0.1"})
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    order = list(MODES)
    for round_ in range(args.rounds):
        for mode in order if round_ % 2 == 0 else order[::-1]:
            proc, base = start(mode, args.model)
            try:
                load(base, args.model, 1, argparse.Namespace(**{**vars(args),
                                                                "num_prompts": 2}))  # warm
                for concurrency in args.concurrency:
                    r = load(base, args.model, concurrency, args)
                    print(f"{mode:15} c={concurrency:<3} {r['output_throughput']:8.1f} tok/s  "
                          f"TTFT median {r['median_ttft_ms']:7.1f} ms  TPOT median "
                          f"{r['median_tpot_ms']:6.1f} ms  failed {r['failed']}", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


if __name__ == "__main__":
    main()
