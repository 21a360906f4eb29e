"""Real processes on loopback for the router tests: `tokenweir serve` replicas (one torch thread
each) and `tokenweir router` in front of them. `start_replica` serves tests/tiny_serve_model.py
(SmolLM2-135M's tokenizer on a tiny random-weight Llama, answering as smollm2-135m): the router
tests are about relaying, routing and failing replicas, not about the model's text."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx

import forkserver  # tests/forkserver.py
import tiny_serve_model  # tests/tiny_serve_model.py

API_KEY = "router-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2-135m"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
REPLICA_MAX_MODEL_LEN = 2048  # room for the long streams that must outlast a replica's failure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENWEIR_API_KEY": API_KEY,
            "NO_PROXY": "127.0.0.1", "PYTHONPATH": os.pathsep.join([ROOT, HERE])}


def start(args: list[str], port: int, ready_s: float = 600) -> subprocess.Popen:
    """`python -m tokenweir ARGS --port PORT`, returned once its /health answers 200."""
    cmd = [sys.executable, "-m", "tokenweir", *args, "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning"]
    proc = forkserver.popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # tests/forkserver.py: torch preloaded
    wait_healthy(proc, f"http://127.0.0.1:{port}", ready_s)
    return proc


def wait_healthy(proc: Optional[subprocess.Popen], base: str, ready_s: float = 600) -> None:
    deadline = time.monotonic() + ready_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited: {proc.stdout.read().decode()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not come up")
        time.sleep(0.1)


def start_replica(port: Optional[int] = None,
                  *extra: str) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = start(["serve", tiny_serve_model.path(), *tiny_serve_model.SERVE_ARGS, "--dtype",
                  "float32", "--max-model-len", str(REPLICA_MAX_MODEL_LEN),
                  "--num-gpu-blocks-override", "256", "--drain-timeout", "5", *extra], port)
    return proc, f"http://127.0.0.1:{port}"


def start_router(replicas: list[str], policy: str = "round-robin",
                 *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["router", "--routing-policy", policy, "--health-interval", "0.3",
            "--health-timeout", "1.5", *extra]
    for url in replicas:
        args += ["--replica", url]
    return start(args, port, ready_s=120), f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total
