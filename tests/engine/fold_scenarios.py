"""Scenarios for the output fold (issue 16): what the engine hands the user, step by step, for
one request or a parallel-sampling group, through every path that folds a step's outputs:
`LLMEngine.step` (final and delta outputs) and `AsyncEngine` (output thread, or inline).

Tokens come from `ScriptedRunner`, a model-free executor (a token id is a hash of the request id
and the position), so the recorded answers depend on the engine's output side only: not on
kernels, dtypes or the machine. The tiny tokenizer (tests/model/tiny_models.py) turns them into
text. `python tests/engine/fold_scenarios.py` re-records fold_golden.json (it was recorded on
the code before the fold was unified; see test_fold_golden.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

from tokenweir import LLM, SamplingParams
from tokenweir.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenweir.engine.async_engine import AsyncEngine
from tokenweir.engine.llm_engine import LLMEngine
from tokenweir.faults import inject

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

GOLDEN = Path(__file__).with_name("fold_golden.json")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
              num_gpu_blocks_override=80, max_num_batched_tokens=64)
PROMPTS = [[5 + (7 * i + 3 * k) % 300 for k in range(12 + 5 * i)] for i in range(4)]


class ScriptedRunner:
    """Samples a token for a request exactly when a step completes its known tokens: id from a
    CRC of (request id, position), never EOS; EOS itself at a position whose CRC is 0 mod 13
    (after two outputs), so samples of a group end at different lengths. Logprobs (when asked)
    are derived from the same CRC."""

    def __init__(self, scheduler, vocab_size: int, eos_token_ids) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.eos = min(eos_token_ids)
        self.regular = [t for t in range(3, vocab_size) if t not in eos_token_ids]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for rid, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            if request.num_computed_tokens + n < request.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            crc = zlib.crc32(f"{rid}:{request.num_tokens}".encode())
            eos = crc % 13 == 0 and request.num_output_tokens >= 2
            token = self.eos if eos else self.regular[crc % len(self.regular)]
            sampled[rid] = [token]
            if request.sampling_params.logprobs is not None:
                top = sorted({token, self.regular[(crc >> 8) % len(self.regular)]})
                logprobs[rid] = TokenLogprobs(-(crc % 997) / 100.0, 1 + crc % 3, top,
                                              [-(crc % 991) / 100.0 - i for i in range(len(top))])
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def tiny_path(folder: Path) -> str:
    make_tiny_model("llama", str(folder), seed=5)
    save_tiny_tokenizer(str(folder), TEMPLATE)
    return str(folder)


def scripted_engine(path: str) -> LLMEngine:
    engine = LLM(path, **ENGINE).llm_engine
    engine.core.executor = ScriptedRunner(engine.scheduler, engine.vocab_size,
                                          engine.eos_token_ids)
    return engine


# ---- the scenarios: (prompt index, request id, params) each -------------------------------
def _p(**kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 9)
    return SamplingParams(temperature=0.8, seed=1, **kw)


SCENARIOS: dict[str, list[tuple[int, str, SamplingParams]]] = {
    "single": [(0, "a", _p()), (1, "b", _p(logprobs=2)), (2, "c", _p(ignore_eos=True))],
    "parallel": [(0, "n3", _p(n=3)), (1, "n2lp", _p(n=2, logprobs=1)),
                 (3, "one", _p(ignore_eos=True))],
    "best_of": [(0, "bo", _p(n=2, best_of=4)), (2, "bo1", _p(n=1, best_of=3)),
                (1, "one", _p())],
    "stop": [(0, "s1", _p(stop=["e"], max_tokens=20)),
             (1, "s2", _p(stop=["o", "a"], include_stop_str_in_output=True, max_tokens=20)),
             (2, "s3", _p(stop=[" "], max_tokens=20, ignore_eos=True)),
             (3, "sg", _p(n=2, stop=["t"], max_tokens=20))],
}

# Faults: scenario name -> (base scenario, phase, request ids, skip).
FAULTS: dict[str, tuple[str, str, set[str], int]] = {
    "detokenize_sample": ("parallel", "detokenize", {"n3#1"}, 2),
    "detokenize_single": ("single", "detokenize", {"b"}, 1),
    "stop_single": ("stop", "stop", {"s2"}, 2),
    "output_group": ("parallel", "output", {"n2lp"}, 1),
    "output_single": ("single", "output", {"a"}, 1),
    "output_best_of": ("best_of", "output", {"bo"}, 0),
}
# Aborts (offline only: the served path's abort lands at a time the test does not control):
# scenario -> (base scenario, step after which the abort comes, output ids aborted).
ABORTS: dict[str, tuple[str, int, list[str]]] = {
    "abort_single": ("single", 3, ["a"]),
    "abort_group": ("parallel", 2, ["n3", "one"]),
    "abort_best_of": ("best_of", 2, ["bo"]),
    "abort_unforked_group": ("parallel", 0, ["n2lp"]),
}


def encode(out, count_logprobs: bool = True) -> dict[str, Any]:
    """A RequestOutput as plain JSON: everything the user sees except timings. (The served
    path's logprob lists are not counted: before the fold was unified, a delta output held the
    processor's live list, whose length at the time the stream reads it depends on thread
    timing; test_fold_golden.py checks the snapshot.)"""
    return {"id": out.request_id, "finished": out.finished, "error": out.error,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish": c.finish_reason, "stop": c.stop_reason,
                         "cum_logprob": c.cumulative_logprob,
                         "logprobs": None if c.logprobs is None or not count_logprobs
                         else len(c.logprobs)}
                        for c in out.outputs]}


# ---- offline: LLMEngine.step ----------------------------------------------------------------
def run_offline(path: str, scenario: str, delta: bool, fault=None, abort=None) -> list:
    """Every step's outputs, encoded, until no request is left."""
    engine = scripted_engine(path)
    for index, rid, params in SCENARIOS[scenario]:
        engine.add_request(*engine.make_request({"prompt_token_ids": PROMPTS[index]}, params,
                                                request_id=rid))
    steps = []
    while engine.has_unfinished_requests():
        if abort is not None and len(steps) == abort[0]:
            steps.append(abort_now(engine, abort[1], delta))
        steps.append([encode(o) for o in engine.step(delta=delta)])
    assert_idle(engine)
    return steps


def abort_now(engine: LLMEngine, output_ids: list[str], delta: bool) -> list:
    """The final outputs (finish reason "abort") of those still in flight. (Recorded when
    LLMEngine.abort_requests returned nothing and left the state to its caller: these were
    built with outputs.make_output after it, then popped.)"""
    return [encode(out) for out in engine.abort_requests(output_ids, delta=delta)]


def assert_idle(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert not engine.outputs.states and not engine.outputs.groups, "output state leaked"


# ---- served: AsyncEngine ------------------------------------------------------------------
def run_served(path: str, scenario: str, output_thread: bool) -> dict[str, list]:
    """Each request's delta outputs, encoded, in the order its stream got them."""
    engine = AsyncEngine(scripted_engine(path), output_thread=output_thread)

    async def one(index: int, rid: str, params: SamplingParams) -> list:
        return [encode(out, count_logprobs=False) async for out in
                engine.generate({"prompt_token_ids": PROMPTS[index]}, params, request_id=rid)]

    async def main() -> list:
        engine.start()
        try:
            return await asyncio.gather(*(one(*s) for s in SCENARIOS[scenario]))
        finally:
            await asyncio.sleep(0.05)
            engine.shutdown()

    streams = asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    assert_idle(engine.engine)
    return {s[1]: stream for s, stream in zip(SCENARIOS[scenario], streams)}


def with_fault(name: str, run: Callable[[str], Any]) -> Any:
    """`run(base scenario)` with the named fault armed; the fault must really fire."""
    base, phase, ids, skip = FAULTS[name]
    with inject(phase, ids, skip=skip) as record:
        result = run(base)
    assert record.fired, f"fault {name} never fired"
    return result


# Served scenarios whose streams do not depend on thread timing. A group with a stop string is
# left out of the output-thread path: before the fold was unified, a sample's token computed
# after its stop string (the engine learns of the stop one step late) went out after the stop
# (see test_fold_golden.py::test_a_sample_stopped_by_a_string_gets_no_more_tokens).
SERVED = ("single", "parallel", "best_of")
SERVED_FAULTS = ("detokenize_sample", "detokenize_single", "output_group", "output_single",
                 "output_best_of")


def record_all(path: str) -> dict[str, Any]:
    golden: dict[str, Any] = {}
    for delta in (False, True):
        for scenario in SCENARIOS:
            golden[f"offline/{scenario}/delta={delta}"] = run_offline(path, scenario, delta)
        for name in FAULTS:
            golden[f"offline/{name}/delta={delta}"] = with_fault(
                name, lambda base: run_offline(path, base, delta))
        for name, (base, step, ids) in ABORTS.items():
            golden[f"offline/{name}/delta={delta}"] = run_offline(path, base, delta,
                                                                   abort=(step, ids))
    for thread in (True, False):
        for scenario in SERVED:
            golden[f"served/{scenario}/thread={thread}"] = run_served(path, scenario, thread)
        for name in SERVED_FAULTS:
            golden[f"served/{name}/thread={thread}"] = with_fault(
                name, lambda base: run_served(path, base, thread))
    return golden


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        recorded = record_all(tiny_path(Path(folder)))
    GOLDEN.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
    print(f"recorded {len(recorded)} runs to {GOLDEN}")
