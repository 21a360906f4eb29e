"""OutputProcessor.fold_step, the one fold of a step's outputs (issue 16), beyond what the
golden comparison (test_fold_golden.py) pins: the two defects the served path had before the
fold was unified, each with the probe that its trigger really happened."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenweir import SamplingParams
from tokenweir.request import RequestStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fold_scenarios as fs  # noqa: E402


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return fs.tiny_path(tmp_path_factory.mktemp("tiny-llama-fold-step"))


def _lagging_run(engine, lag_steps: int = 1) -> tuple[list, int]:
    """Step the engine as the output thread sees it: a stop string found while folding step k
    reaches the scheduler only after step k + lag_steps ran. Returns every delta output and
    how many core outputs came for a sample already stopped on the output side."""
    pending: list[tuple[int, str]] = []  # (step it is applied after, request id)
    stopped: set[str] = set()
    late, outputs, step = 0, [], 0
    while engine.has_unfinished_requests():
        for when, request_id in [p for p in pending if p[0] < step]:
            engine.core.abort_requests([request_id], RequestStatus.FINISHED_STOPPED)
            pending.remove((when, request_id))
        core_outputs = engine.core.step()
        late += sum(o.request.request_id in stopped for o in core_outputs)

        def on_stop(request, at=step) -> None:
            stopped.add(request.request_id)
            pending.append((at + lag_steps, request.request_id))

        made = engine.outputs.fold_step(core_outputs, engine.core.clock(), delta=True,
                                        on_stop=on_stop, on_fail=lambda ids, message: None)
        outputs += made.values()
        step += 1
    return outputs, late


def test_a_sample_stopped_by_a_string_gets_no_more_tokens(tiny_path):
    """A group sample's stop string is found one step before the scheduler finishes it: the
    token computed meanwhile is dropped, so the sample's streamed text ends at the stop."""
    engine = fs.scripted_engine(tiny_path)
    params = SamplingParams(n=2, stop=["t"], max_tokens=20, temperature=0.8, seed=1)
    engine.add_request(*engine.make_request({"prompt_token_ids": fs.PROMPTS[3]}, params,
                                            request_id="sg"))
    outputs, late = _lagging_run(engine)
    assert late >= 1, "probe: the engine computed a token after the stop string"
    texts = {0: "", 1: ""}
    finishes = {}
    for out in outputs:
        for c in out.outputs:
            assert c.index not in finishes, f"sample {c.index} streamed after it finished"
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index] = (c.finish_reason, c.stop_reason)
    assert finishes[1] == ("stop", "t"), "probe: sample 1 was ended by the stop string"
    assert "t" not in texts[1], texts[1]
    assert outputs[-1].finished and not engine.outputs.states


def test_delta_outputs_hold_a_snapshot_of_the_logprobs(tiny_path):
    """Each output's logprobs are the positions up to its own tokens, however many steps
    later they are read (the served path's event loop reads them after the output thread
    moved on)."""
    engine = fs.scripted_engine(tiny_path)
    params = SamplingParams(max_tokens=8, logprobs=1, ignore_eos=True)
    engine.add_request(*engine.make_request({"prompt_token_ids": fs.PROMPTS[0]}, params,
                                            request_id="lp"))
    held = []
    while engine.has_unfinished_requests():
        held += engine.step(delta=True)
    assert len(held) == 8, "probe: one delta per token, each read after the run"
    assert [len(out.outputs[0].logprobs) for out in held] == list(range(1, 9))


@pytest.mark.parametrize("output_thread", [True, False])
@pytest.mark.parametrize("scenario", sorted(fs.SCENARIOS))
def test_served_streams_are_the_offline_deltas(tiny_path, scenario, output_thread):
    """Both callers of the fold give each request the same delta outputs, stop strings in a
    group included (on the output thread the engine learns of a stop one step late)."""
    offline: dict[str, list] = {}
    for step in fs.run_offline(tiny_path, scenario, delta=True):
        for out in step:
            out["outputs"] = [{**c, "logprobs": None} for c in out["outputs"]]
            offline.setdefault(out["id"], []).append(out)
    served = fs.run_served(tiny_path, scenario, output_thread)
    assert served == offline
    assert any(out["finished"] for stream in served.values() for out in stream)


def test_abort_returns_the_final_outputs_and_forgets_the_state(tiny_path):
    """LLMEngine.abort_requests gives each in-flight request's (group's) final "abort" output
    and releases its output state: before, the state stayed unless the caller popped it (a
    leak in benchmarks/soak_rss.py, which aborts a tenth of its requests)."""
    engine = fs.scripted_engine(tiny_path)
    for index, rid, params in fs.SCENARIOS["parallel"]:
        engine.add_request(*engine.make_request({"prompt_token_ids": fs.PROMPTS[index]},
                                                params, request_id=rid))
    streamed = {out.request_id for _ in range(2) for out in engine.step(delta=True)}
    assert streamed == {"n3", "n2lp", "one"}, "probe: all three were in flight"
    finals = engine.abort_requests(["n3", "one", "unknown"])
    assert [f.request_id for f in finals] == ["n3", "one"] and all(f.finished for f in finals)
    assert {c.finish_reason for f in finals for c in f.outputs} == {"abort"}
    assert len(finals[0].outputs) == 3 and sorted(engine.outputs.states) == ["n2lp"]
    while engine.has_unfinished_requests():
        assert all(out.request_id == "n2lp" for out in engine.step())
    fs.assert_idle(engine)


@pytest.mark.parametrize("scenario", ["single", "parallel", "stop", "detokenize_single"])
def test_final_only_steps_give_the_same_finals(tiny_path, scenario):
    """step(final_only=True), what LLM.generate uses: the final outputs equal the ones the
    every-step outputs end with (stop strings and a failing detokenizer included), lone
    requests show nothing before they finish (probe: they do show something in the plain
    run), and groups still show every step."""
    def run(final_only: bool) -> tuple[dict, int]:
        engine = fs.scripted_engine(tiny_path)
        base = fs.FAULTS[scenario][0] if scenario in fs.FAULTS else scenario
        for index, rid, params in fs.SCENARIOS[base]:
            engine.add_request(*engine.make_request({"prompt_token_ids": fs.PROMPTS[index]},
                                                    params, request_id=rid))
        finals, unfinished_lone = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=final_only):
                lone = out.request_id not in {"n3", "n2lp", "sg"}
                unfinished_lone += lone and not out.finished
                if out.finished:
                    finals[out.request_id] = fs.encode(out)
        fs.assert_idle(engine)
        return finals, unfinished_lone

    if scenario in fs.FAULTS:  # each run under its own armed fault (it must fire in each)
        plain, shown = fs.with_fault(scenario, lambda _: run(False))
        final, hidden = fs.with_fault(scenario, lambda _: run(True))
        assert any(f["error"] for f in final.values()), "probe: the fault failed a request"
    else:
        (plain, shown), (final, hidden) = run(False), run(True)
    assert final == plain and shown > 0 and hidden == 0
