"""`tokenweir serve --scheduling-policy slo --slo-reject-hopeless`: a request whose TTFT target
the policy's predictor says it cannot meet even alone is answered 503 with Retry-After (nothing
queued); a feasible one on the same server, and the same hopeless one on a server without the
flag, are served. The predictor is given (1 ms per prompt token + 50 ms), so "hopeless" is a
known number: a 10 ms target is below 50 ms whatever the prompt."""

from __future__ import annotations

import os

import probes  # tests/server/probes.py (pytest puts this folder on sys.path)
from tokenweir.core.sched import slo

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PREDICTOR = ("--scheduling-policy", "slo", "--slo-ttft-a-ms-per-token", "1",
             "--slo-ttft-c-ms", "50")


def test_infeasible_alone_is_the_hopeless_rule_at_arrival():
    p = slo.TTFTPredictor(a=0.001, c=0.05)
    assert slo.infeasible_alone(p, 100, ttft_target=0.149)  # predicted 0.150
    assert not slo.infeasible_alone(p, 100, ttft_target=0.151)
    assert not slo.infeasible_alone(p, 100, ttft_target=0.12, tolerance=0.25)  # a near miss


def _serve(*extra):
    proc, base = probes.start_server(ROOT, *PREDICTOR, *extra)
    return proc, base


def test_hopeless_request_is_503_with_retry_after_and_a_feasible_one_is_served():
    proc, base = _serve("--slo-reject-hopeless")
    try:
        hopeless = probes.post(base, "/v1/completions", probes.completion(ttft_slo_ms=10))
        assert hopeless.status_code == 503, hopeless.text
        assert hopeless.headers.get("retry-after") == "1"
        assert hopeless.json()["error"]["param"] == "ttft_slo_ms"
        feasible = probes.post(base, "/v1/completions", probes.completion(ttft_slo_ms=60_000))
        assert feasible.status_code == 200, feasible.text
        assert feasible.json()["choices"][0]["text"] is not None
    finally:
        probes.stop_server(proc)
    # the probe: without the flag the same hopeless request is served (late)
    proc, base = _serve()
    try:
        served = probes.post(base, "/v1/completions", probes.completion(ttft_slo_ms=10))
        assert served.status_code == 200, served.text
    finally:
        probes.stop_server(proc)
