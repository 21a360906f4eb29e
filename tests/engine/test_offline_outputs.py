"""The host-side work of an offline step was cut (issue 33, host6: deferred detokenisation,
flat decode batches) without changing one token id or text: offline_outputs.py's workload
(greedy, seeded sampling, stop strings, n=2, best_of, penalties, logprobs, an abort, steps
in mixed output modes) gives exactly the outputs recorded on main 495a511 before the change
(offline_outputs.json)."""

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
    assert json.loads(json.dumps(oo.run_generate(tiny_path))) == GOLDEN["generate"]
    assert deferrals["bulk"] > 100 and deferrals["catch_up"] > 10, deferrals


def test_mixed_mode_steps_are_the_recorded_ones(tiny_path, deferrals):
    assert json.loads(json.dumps(oo.run_mixed(tiny_path))) == GOLDEN["mixed"]
    assert deferrals["bulk"] > 50 and deferrals["catch_up"] > 10, deferrals
