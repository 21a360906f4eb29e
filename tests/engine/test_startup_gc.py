"""tokenweir/startup_gc.py: `generate` and `serve` build their engine with the cyclic garbage
collector paused, then freeze what is alive and resume; the tokens are those of a start with
the collector on (TOKENWEIR_STARTUP_GC=1). `serve`'s engine core process pauses it during its
build too (core_process._build)."""

from __future__ import annotations

import gc

import pytest

from tokenweir import startup_gc
from tokenweir.engine.llm import LLM as EngineLLM
from tokenweir.engine.llm_engine import LLMEngine

from gc_passes import counting_passes  # tests/gc_passes.py

_INIT, _RUN = LLMEngine.__init__, EngineLLM._run  # unwrapped, whatever a test patched


@pytest.fixture
def collector():
    """Passes seen by the collector (gc.callbacks), counted while the test runs; afterwards
    the collector on and nothing frozen, as before the test."""
    try:
        with counting_passes() as passes:
            yield passes
    finally:
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
    # in-process: the engine process builds in its child (checked by the test below)
    assert main(["serve", tiny_llama_path, "--dtype", "float32", "--port", "0",
                 "--no-engine-process"]) == 0
    assert built == [False] and serving == [(True, True)]


# `serve`'s engine core process (engine/core_process.py) builds in its own process, where the
# test process's patches reach it only through the fork: this script, run as a process of its
# own (tests/forkserver.py), forks the core as `serve` does (CoreClient.start), and the core
# prints what the collector did during `core_process._build`.
CORE_SCRIPT = """
import gc, json, sys
from tokenweir.config import EngineConfig
from tokenweir.engine import core_process
from tokenweir.engine.core_client import CoreClient

passes = []
gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(info["generation"]))
build = core_process._build

def traced(config):  # runs in the core process (the fork inherits this module's patch)
    before, frozen = len(passes), gc.get_freeze_count()
    engine = build(config)
    print(json.dumps({"passes": len(passes) - before, "enabled": gc.isenabled(),
                      "froze": gc.get_freeze_count() > frozen}), flush=True)
    return engine

core_process._build = traced
client = CoreClient.start(EngineConfig.from_kwargs(model=sys.argv[1], dtype="float32"), 0,
                          "warning")
client.wait_ready()
client.send(("shutdown",))
assert client.ended.result(120) is None
client.close()
"""


def _core_build(path: str, tmp_path, switch: str) -> dict:
    """What the collector did during the core process's build (TOKENWEIR_STARTUP_GC=switch)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import forkserver

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "core_gc.py"
    script.write_text(CORE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1",
           "TOKENWEIR_STARTUP_GC": switch}
    done = forkserver.run([sys.executable, str(script), path], env=env, cwd=str(tmp_path),
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_core_process_builds_with_the_collector_paused(tiny_llama_path, tmp_path):
    paused = _core_build(tiny_llama_path, tmp_path, "0")
    assert paused == {"passes": 0, "enabled": True, "froze": True}
    # probe: the same build with the collector left alone runs passes
    alone = _core_build(tiny_llama_path, tmp_path, "1")
    assert alone["passes"] > 0 and not alone["froze"], alone
