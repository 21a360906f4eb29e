"""Whole engines on each attention backend (tokenweir/model/backends): the per-request SDPA
reference and the Triton kernel (interpreted on CPU) give the greedy tokens of the default
path, through chunked prefill, decodes beside prefill chunks and prefix-cache hits."""

from __future__ import annotations

import importlib.util

import pytest

from tokenweir import LLM, SamplingParams
from tokenweir.model import backends

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 31] * 3, [8, 8, 100], list(range(20, 60)),
           [5, 17, 99, 3, 42, 7, 250, 31] * 3 + [1, 2]]  # shares 24 tokens with the first


def _greedy(path: str, backend_name: str, monkeypatch) -> tuple[list[list[int]], str]:
    monkeypatch.setenv(backends.ENV, backend_name)
    llm = LLM(model=path, dtype="float32", device="cpu", seed=0, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    runner = llm.llm_engine.core.executor
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    used = getattr(runner.attention_backend, "name", "cpu")
    return [list(o.outputs[0].token_ids) for o in outs], used


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_backend_engine_matches_the_cpu_path(name, tiny_llama_path, monkeypatch):
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed (the `gpu` extra)")
    expected, used_default = _greedy(tiny_llama_path, "cpu", monkeypatch)
    got, used = _greedy(tiny_llama_path, name, monkeypatch)
    assert (used_default, used) == ("cpu", name)  # probe: the backend really ran the steps
    assert got == expected
