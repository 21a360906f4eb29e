"""The server's OpenAPI schema fuzzed with schemathesis against a live `tokenweir serve`: valid
and invalid bodies for every operation, bounded examples (well under a minute). No answer may
be a 5xx, none may hang, and the engine must serve normally afterwards.

Generated requests keep their shape, but the number of tokens they ask for is capped (at most
2 generated, 1 required; a missing max_tokens is set to 2) so that an accepted request costs a
fraction of a second.

The server runs tests/tiny_serve_model.py (SmolLM2-135M's tokenizer, template, vocabulary and
special tokens on a tiny random-weight Llama, answering as smollm2-135m): what is fuzzed is the
server's handling of requests, and an accepted request's two steps cost ~1/100 of SmolLM2's
(an accepted request cost ~0.15-0.4 s on SmolLM2 float32, nearly all of it its forwards)."""

from __future__ import annotations

import collections
import os
import time

import httpx
import pytest

import probes  # tests/server/probes.py
import tiny_serve_model  # tests/tiny_serve_model.py

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES_PER_MODE = {"/v1/completions": 50, "/v1/chat/completions": 50}
TOKEN_CAPS = {"max_tokens": 2, "max_completion_tokens": 2, "min_tokens": 1}


def _cap_tokens(case) -> None:
    body = case.body
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = TOKEN_CAPS["max_tokens"]  # chat's default: the whole context
        for name, cap in TOKEN_CAPS.items():
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[name] = cap


def _fuzz(schema, base: str, path: str, method: str, mode, examples: int,
          statuses: collections.Counter) -> None:
    # imported here, not at collection: every xdist worker collects this file, one runs it
    from hypothesis import HealthCheck, given, settings

    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        _cap_tokens(case)
        response = case.call(base_url=base, headers=probes.HEADERS, timeout=30)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.body, response.text[:500])

    run()


@pytest.fixture(scope="module")
def schemathesis():
    """Imported here, not at collection: every xdist worker collects this file, one runs it
    (the import is ~0.5 s). Its pytest plugin is off (pyproject's addopts): this file uses
    it as a library."""
    return pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(schemathesis):
    proc, base = probes.start_server(ROOT, *tiny_serve_model.SERVE_ARGS, "--max-waiting-requests",
                                     "64", model=tiny_serve_model.path())
    try:
        yield base
    finally:
        probes.stop_server(proc)


def test_openapi_fuzz_no_5xx_and_engine_serves_after(server, schemathesis):
    started = time.monotonic()
    document = httpx.get(server + "/openapi.json", trust_env=False, timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    statuses: collections.Counter = collections.Counter()
    for path, examples in EXAMPLES_PER_MODE.items():
        for mode in modes:
            _fuzz(schema, server, path, "POST", mode, examples, statuses)
    for path in ("/health", "/v1/models"):
        _fuzz(schema, server, path, "GET", modes[0], 3, statuses)
    fuzz_seconds = time.monotonic() - started
    # probe: the fuzzer really got requests through and really got them refused
    assert statuses[200] >= 10 and statuses[400] >= 10, statuses
    with probes.neighbour(server) as neighbour:
        pass
    assert neighbour["ok"], neighbour  # the engine serves in full afterwards
    print(f"fuzzed {sum(statuses.values())} requests in {fuzz_seconds:.1f} s: {dict(statuses)}")


# What the fuzzer found (a variant of run()'s source drew it): a finite temperature beyond
# float32's range with EOS masked (min_tokens) made the sampler's weights NaN and its draw
# index past the vocabulary, a 500. Pinned here, end to end and on the sampler alone.
HUGE_TEMPERATURE = 8.789124501359472e+134


def test_a_temperature_beyond_float32_is_served(server):
    import torch

    assert torch.tensor(HUGE_TEMPERATURE, dtype=torch.float32).isinf()  # probe: out of range
    body = {"model": probes.MODEL, "prompt": "\x1f\x9c럚\x15£", "temperature": HUGE_TEMPERATURE,
            "min_tokens": 1, "max_tokens": 2}
    response = probes.post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_huge_temperature_draws_as_the_largest_finite_one():
    """Beyond float32, a row draws what it draws at 1e30 (every allowed token weighs ~1), for
    the plain, top-k and top-p paths, and never a masked token (EOS, under min_tokens)."""
    import torch

    from tokenweir.model.sampler import sample
    from tokenweir.request import SamplingParams

    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    logits[:, 7] = 50.0  # EOS would win every draw were it not masked

    def draws(temperature: float, min_tokens: int = 1, **extra) -> list[int]:
        params = [SamplingParams(temperature=temperature, min_tokens=min_tokens, seed=seed,
                                 **extra) for seed in range(3)]
        return sample(logits, params, [0, 0, 0], frozenset({7}), 0, 0).token_ids

    assert draws(1.0, min_tokens=0) == [7, 7, 7]  # probe: unmasked, EOS is every draw
    for extra in ({}, {"top_k": 5}, {"top_p": 0.9}):
        huge = draws(HUGE_TEMPERATURE, **extra)
        assert huge == draws(1e30, **extra) and 7 not in huge, extra
