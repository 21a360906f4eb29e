"""The host-side work of an offline step was cut (issue 33, host6: deferred detokenisation,
flat decode batches) without changing one token id or text: offline_outputs.py's workload
(greedy, seeded sampling, stop strings, n=2, best_of, penalties, logprobs, an abort, steps
in mixed output modes) gives exactly the outputs recorded on main 495a511 before the change
(offline_outputs.json). Token ids, texts, endings, ranks: exact. The float32 log-probabilities
may differ from the recording in their last bits on another kind of CPU (the recording is
from an AVX2 machine; an AVX-512 one sums the logits in another order: up to 1.4e-6 on a
cum_logprob of -60 here, the same tokens): they are compared within LOGPROB_TOLERANCE."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offline_outputs as oo  # noqa: E402
from tokenweir.engine.output_processor import OutputProcessor  # noqa: E402
from tokenweir.model.tokenizer import IncrementalDetokenizer  # noqa: E402

GOLDEN = json.loads(oo.GOLDEN.read_text(encoding="utf-8"))
# ~70x the largest difference between the AVX2 recording and an AVX-512 BF16 machine; a
# changed token, step or sampling path moves a log-probability by orders of magnitude more.
LOGPROB_TOLERANCE = 1e-4


def _floats_apart(value, floats: list):
    """`value` with every float replaced by None (collected into `floats`, dict keys in sorted
    order: the recording's keys are sorted, a run's are not)."""
    if isinstance(value, float):
        floats.append(value)
        return None
    if isinstance(value, dict):
        return {k: _floats_apart(value[k], floats) for k in sorted(value)}
    if isinstance(value, list):
        return [_floats_apart(v, floats) for v in value]
    return value


def assert_same_outputs(got, recorded) -> None:
    """Everything but the floats exactly; the floats within LOGPROB_TOLERANCE."""
    got_floats: list = []
    recorded_floats: list = []
    got = _floats_apart(json.loads(json.dumps(got)), got_floats)
    assert got == _floats_apart(recorded, recorded_floats)
    assert len(got_floats) == len(recorded_floats) >= 100  # probe: the log-probs were compared
    assert got_floats == pytest.approx(recorded_floats, rel=0, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return oo.tiny_path(tmp_path_factory.mktemp("tiny-llama-offline"))


def test_recording_is_not_trivial():
    """Probe: the recording holds string stops, EOS and length endings, logprobs, groups,
    an abort, split multi-byte characters (U+FFFD mid-text) and whole ones."""
    outs = [c for o in GOLDEN["generate"] for c in o["outputs"]]
    finishes = {(c["finish"], c["stop"]) for c in outs}
    assert ("stop", "e") in finishes and ("stop", None) in finishes
    assert any(f == "length" for f, _ in finishes)
    assert any(c["logprobs"] for c in outs)
    assert any(len(o["outputs"]) == 2 for o in GOLDEN["generate"])
    assert any("\ufffd" in c["text"] for c in outs)
    assert any(ch in c["text"] for c in outs for ch in "é東京🤗")
    mixed = [o for step in GOLDEN["mixed"] for o in step]
    assert any(c["finish"] == "abort" for o in mixed for c in o["outputs"])
    assert any(not o["finished"] for o in mixed), "probe: full outputs mid-way were recorded"


@pytest.fixture
def deferrals(monkeypatch) -> dict[str, int]:
    """Probe that text really was deferred: tokens the bulk path listed by id, and catch-ups
    that fed more than one held token at once."""
    seen = {"bulk": 0, "catch_up": 0}
    defer, add_each = OutputProcessor.defer, IncrementalDetokenizer.add_each

    def counting_defer(self, request_ids, now):
        seen["bulk"] += len(request_ids)
        return defer(self, request_ids, now)

    def counting_add_each(self, token_ids):
        seen["catch_up"] += len(token_ids) > 1
        return add_each(self, token_ids)

    monkeypatch.setattr(OutputProcessor, "defer", counting_defer)
    monkeypatch.setattr(IncrementalDetokenizer, "add_each", counting_add_each)
    return seen


def test_generate_outputs_are_the_recorded_ones(tiny_path, deferrals):
    assert_same_outputs(oo.run_generate(tiny_path), GOLDEN["generate"])
    assert deferrals["bulk"] > 100 and deferrals["catch_up"] > 10, deferrals


def test_mixed_mode_steps_are_the_recorded_ones(tiny_path, deferrals):
    assert_same_outputs(oo.run_mixed(tiny_path), GOLDEN["mixed"])
    assert deferrals["bulk"] > 50 and deferrals["catch_up"] > 10, deferrals


@pytest.mark.parametrize("change", ["token", "logprob"])
def test_the_comparison_sees_a_changed_token_and_a_moved_logprob(change):
    """Probe of assert_same_outputs: one token id, or one log-probability moved by 1e-3."""
    import copy

    changed = copy.deepcopy(GOLDEN["generate"])
    output = next(c for o in changed for c in o["outputs"] if c["cum_logprob"] is not None)
    if change == "token":
        output["token_ids"][0] += 1
    else:
        output["cum_logprob"] += 1e-3
    assert_same_outputs(GOLDEN["generate"], GOLDEN["generate"])
    with pytest.raises(AssertionError):
        assert_same_outputs(changed, GOLDEN["generate"])
