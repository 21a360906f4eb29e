"""`tokenweir serve --data-parallel-size 2`: two replica processes behind the router on the
one port, both serving; SIGTERM stops the router and the replicas."""

from __future__ import annotations

import signal

import httpx

from deployment import HEADERS, MODEL, free_port, metric, start


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
