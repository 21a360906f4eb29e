"""`tokenweir serve --scheduling-policy slo --slo-reject-hopeless`: a request whose TTFT target
the policy's predictor says it cannot meet even alone is answered 503 with Retry-After (nothing
queued); a feasible one on the same server, and the same hopeless one on a server without the
flag, are served. The predictor is given (1 ms per prompt token + 50 ms), so "hopeless" is a
known number: a 10 ms target is below 50 ms whatever the prompt. The flag is checked on a
`tokenweir serve` subprocess; the probe without it (the same request is served) runs the same
app in-process on the shared weights (one server start less: ~7.5 CPU-s)."""

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

def test_without_the_flag_the_same_hopeless_request_is_served(smollm2_f32):
    """The probe: the same predictor, policy and request, no --slo-reject-hopeless: 200."""
    from fastapi.testclient import TestClient

    from tokenweir.config import EngineConfig
    from tokenweir.engine.async_engine import AsyncEngine
    from tokenweir.engine.llm_engine import LLMEngine
    from tokenweir.server.app import create_app
    from tokenweir.server.settings import ServerSettings

    config = EngineConfig.from_kwargs(
        model=probes.MODEL, dtype="float32", device="cpu", max_model_len=1024,
        num_gpu_blocks_override=512, scheduling_policy="slo", slo_ttft_a_ms_per_token=1.0,
        slo_ttft_c_ms=50.0)
    engine = AsyncEngine(LLMEngine(config, loaded=smollm2_f32))
    settings = ServerSettings(served_model_names=(probes.MODEL,))
    assert settings.slo_reject_hopeless is False  # the flag's default: what serve runs without it
    with TestClient(create_app(engine, settings)) as client:
        served = client.post("/v1/completions", json=probes.completion(ttft_slo_ms=10))
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 4
