"""`tokenweir serve --data-parallel-size 2`: two replica processes behind the router on the
one port, both serving, each on cores of its own; SIGTERM stops the router and the replicas."""

from __future__ import annotations

import os
import signal

import httpx

from deployment import HEADERS, MODEL, free_port, metric, start
from tokenweir.router.dp import core_shares


def test_core_shares_are_equal_and_disjoint():
    assert core_shares([0, 1], 2) == [[0], [1]]
    assert core_shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert core_shares([5], 2) == [None, None]
    assert cpu_list("0-1,3\n") == [0, 1, 3] and cpu_list("1") == [1]


def cpu_list(text: str) -> list[int]:
    """/proc's Cpus_allowed_list ("0-1,3") as the cores it names."""
    cores = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


def replica_cores(parent: int) -> list[list[int]]:
    """The cores each replica may run on: the children of `parent` that run tokenweir serve
    (multiprocessing's spawned interpreters)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("PPid") == str(parent) and "spawn_main" in cmdline:
            found.append(cpu_list(fields["Cpus_allowed_list"]))
    return sorted(found)


def test_two_replicas_behind_the_router_on_one_port_and_all_stop_on_sigterm():
    port = free_port()
    proc = start(["serve", MODEL, "--dtype", "float32", "--max-model-len", "512",
                  "--num-gpu-blocks-override", "256", "--drain-timeout", "5",
                  "--data-parallel-size", "2", "--routing-policy", "round-robin"], port)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(2):
            answer = httpx.post(base + "/v1/completions", headers=HEADERS, timeout=120,
                                trust_env=False, json={"prompt": "Hi", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        text = httpx.get(base + "/metrics", timeout=30, trust_env=False).text
        from prometheus_client.parser import text_string_to_metric_families

        replicas = {s.labels["replica"] for f in text_string_to_metric_families(text)
                    for s in f.samples if f.name == "tokenweir:router_replica_up"}
        assert len(replicas) == 2 and base not in replicas  # two processes of their own
        shares = core_shares(sorted(os.sched_getaffinity(0)), 2)
        if shares[0] is not None:  # each pinned to its own share of this machine's cores
            assert replica_cores(proc.pid) == shares
        for url in replicas:
            assert metric(text, "tokenweir:router_routed_total", replica=url) == 1
            assert metric(text, "tokenweir:request_success_total", replica=url) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        for url in replicas:  # probe: the replicas went with it
            try:
                httpx.get(url + "/health", timeout=3, trust_env=False)
                raise AssertionError(f"{url} still answers")
            except httpx.ConnectError:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
