"""One thread for all torch work in a server (engine/engine_thread.py): EngineThread runs its
jobs in order and hands back results and exceptions; `tokenweir serve`'s layout (the engine
built with EngineThread.call, the loop on the same thread) builds, warms up and steps the model
on that one thread and on no other (the probe records the thread of every model forward), and
serves the same tokens as the offline engine."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from tokenweir import LLM, SamplingParams
from tokenweir.config import EngineConfig
from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.engine_thread import EngineThread, wants_output_thread
from tokenweir.engine.llm_engine import LLMEngine
from tokenweir.model.llama import CausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              num_gpu_blocks_override=80, max_num_batched_tokens=64)
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 31], [8, 8, 100], list(range(20, 50))]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-engine-thread")
    make_tiny_model("llama", str(path), seed=5)
    save_tiny_tokenizer(str(path), "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return str(path)


def test_jobs_run_in_order_on_the_thread_and_report_back():
    worker = EngineThread()
    order: list[int] = []
    assert worker.call(lambda: threading.current_thread().name) == "tokenweir-engine"
    futures = [worker.submit(lambda i=i: order.append(i) or i) for i in range(5)]
    assert [f.result(timeout=5) for f in futures] == list(range(5)) and order == list(range(5))
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    worker.stop()
    worker.join(timeout=5)
    assert not worker.is_alive()  # the probe: stop really ended it


def test_the_served_engine_is_built_and_stepped_on_one_thread(tiny_path, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")  # the warm-up's forwards count too
    forward_threads: set[int] = set()
    forward = CausalLM.forward

    def recording(self, *args, **kwargs):
        forward_threads.add(threading.get_ident())
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(CausalLM, "forward", recording)
    worker = EngineThread()
    config = EngineConfig.from_kwargs(model=tiny_path, **ENGINE)
    engine = AsyncEngine(worker.call(lambda: LLMEngine(config)), engine_thread=worker)
    built_on = set(forward_threads)
    assert built_on == {worker.ident}  # the warm-up ran on the engine thread

    async def main() -> list[list[int]]:
        engine.start()
        try:
            got = []
            for i, ids in enumerate(PROMPTS):
                tokens: list[int] = []
                async for out in engine.generate(
                        {"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        request_id=f"r{i}"):
                    tokens += out.outputs[0].token_ids
                got.append(tokens)
            return got
        finally:
            engine.shutdown()
    served = asyncio.run(main())
    assert forward_threads == {worker.ident} != {threading.main_thread().ident}
    monkeypatch.setattr(CausalLM, "forward", forward)
    monkeypatch.setenv("TOKENWEIR_WARMUP", "0")
    offline = LLM(tiny_path, **ENGINE).generate(
        [{"prompt_token_ids": ids} for ids in PROMPTS],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert served == [list(o.outputs[0].token_ids) for o in offline]
    worker.join(timeout=30)
    assert not worker.is_alive()  # the loop was its last job: shutdown ended the thread


@pytest.mark.parametrize("spare", [0, 1])
def test_auto_output_thread_only_with_a_core_beside_torchs_threads(monkeypatch, spare):
    worker = EngineThread()
    try:
        torch_threads = worker.call(__import__("torch").get_num_threads)
        seen = []  # the probe: auto really asked for the process's cores

        def cores(pid):
            seen.append(pid)
            return set(range(torch_threads + spare))

        monkeypatch.setattr("os.sched_getaffinity", cores)
        assert wants_output_thread("auto", worker) is bool(spare)
        assert seen == [0]
        assert wants_output_thread("on", worker) and not wants_output_thread("off", worker)
        assert seen == [0]  # on / off never look
    finally:
        worker.stop()
