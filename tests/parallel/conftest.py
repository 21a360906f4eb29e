"""Shared fixtures for the tensor-parallel tests: a tiny random Llama on disk (workers load
it by path) and helpers to drive an executor with the real scheduler."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("model", "core"):
    if os.path.join(_TESTS, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(_TESTS, _sub))

from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """4 heads, 2 KV heads, MLP 128, 2 layers: splits evenly over 2 ranks."""
    path = tmp_path_factory.mktemp("tp-tiny-llama")
    make_tiny_model("llama", str(path), seed=3)
    save_tiny_tokenizer(str(path), CHATML)
    return str(path)


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
