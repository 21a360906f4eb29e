"""tokenweir/startup_gc.py: `generate` and `serve` build their engine with the cyclic garbage
collector paused, then freeze what is alive and resume; the tokens are those of a start with
the collector on (TOKENWEIR_STARTUP_GC=1)."""

from __future__ import annotations

import gc

import pytest

from tokenweir import startup_gc
from tokenweir.engine.llm import LLM as EngineLLM
from tokenweir.engine.llm_engine import LLMEngine

_INIT, _RUN = LLMEngine.__init__, EngineLLM._run  # unwrapped, whatever a test patched


@pytest.fixture
def collector():
    """Passes seen by the collector (gc.callbacks), counted while the test runs; afterwards
    the collector on and nothing frozen, as before the test."""
    passes: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.callbacks.append(count)
    try:
        yield passes
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
        gc.enable()


def _cyclic_garbage(n: int = 20_000) -> None:
    for _ in range(n):
        cycle: list = []
        cycle.append(cycle)


def test_paused_runs_no_pass_then_freezes_and_resumes(collector, monkeypatch):
    monkeypatch.delenv("TOKENWEIR_STARTUP_GC", raising=False)
    frozen = gc.get_freeze_count()
    with startup_gc.paused():
        assert not gc.isenabled()
        _cyclic_garbage()
        assert collector == []
    assert gc.isenabled() and gc.get_freeze_count() > frozen
    _cyclic_garbage()
    assert collector  # probe: the same allocations do trigger passes with the collector on


def test_the_switch_leaves_the_collector_alone(collector, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_STARTUP_GC", "1")
    with startup_gc.paused():
        assert gc.isenabled()
        _cyclic_garbage()
    assert collector and gc.get_freeze_count() == 0


def test_only_the_outer_block_resumes(collector, monkeypatch):
    monkeypatch.delenv("TOKENWEIR_STARTUP_GC", raising=False)
    with startup_gc.paused():
        with startup_gc.paused():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.isenabled() and gc.get_freeze_count() > 0


def _generate(path: str, monkeypatch, built: list) -> list[list[int]]:
    """`tokenweir generate` in this process: its token ids; built gets whether the collector
    was on when the engine's build ended."""
    from tokenweir.cli import main

    outputs, run, init = [], _RUN, _INIT

    def build(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(gc.isenabled())

    monkeypatch.setattr(LLMEngine, "__init__", build)
    monkeypatch.setattr(EngineLLM, "_run", lambda self, *a: outputs.append(run(self, *a))
                        or outputs[-1])
    assert main(["generate", "--model", path, "--dtype", "float32", "--no-chat",
                 "--max-tokens", "8", "--prompt", "The river", "--prompt", "A cat sat"]) == 0
    return [list(o.outputs[0].token_ids) for o in outputs[0]]


def test_generate_builds_with_the_collector_paused_and_the_same_tokens(
        tiny_llama_path, collector, monkeypatch):
    monkeypatch.delenv("TOKENWEIR_STARTUP_GC", raising=False)
    built: list[bool] = []
    paused_tokens = _generate(tiny_llama_path, monkeypatch, built)
    assert built == [False] and gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    monkeypatch.setenv("TOKENWEIR_STARTUP_GC", "1")
    assert _generate(tiny_llama_path, monkeypatch, built) == paused_tokens
    assert built == [False, True]  # probe: with the switch, the build ran with it on


def test_serve_builds_with_the_collector_paused_and_serves_with_it_on(
        tiny_llama_path, collector, monkeypatch):
    from tokenweir.cli import main
    from tokenweir.server import serve as serve_module

    monkeypatch.delenv("TOKENWEIR_STARTUP_GC", raising=False)
    built, serving, init = [], [], _INIT

    def build(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(gc.isenabled())

    def serve(engine, settings, host, port, log_level):
        serving.append((gc.isenabled(), gc.get_freeze_count() > 0))
        engine.shutdown()
        return 0

    monkeypatch.setattr(LLMEngine, "__init__", build)
    monkeypatch.setattr(serve_module, "serve", serve)
    # in-process: the engine process builds in its child (core_process.py pauses it there too)
    assert main(["serve", tiny_llama_path, "--dtype", "float32", "--port", "0",
                 "--no-engine-process"]) == 0
    assert built == [False] and serving == [(True, True)]
