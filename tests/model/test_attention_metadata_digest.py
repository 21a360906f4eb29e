"""build_attention_metadata's decode fast path (issue 33, host6) changed nothing: the
metadata of 60 random steps (decodes only, prefills only, mixed; block sizes 1, 8, 16; tables
longer than needed) digests exactly as recorded before it (attention_metadata_cases.py)."""

from __future__ import annotations

import json

import attention_metadata_cases as amc


def test_metadata_digests_are_the_recorded_ones():
    recorded = json.loads(amc.DIGESTS.read_text())
    assert len(recorded) == 60 and len(set(recorded)) == 60
    assert amc.all_digests() == recorded


def test_cases_cover_decode_only_and_mixed_steps():
    """Probe: the cases hold decode-only steps (the fast path) and steps with prefills."""
    kinds = {(all(q == 1 for q in query), any(q > 1 for q in query))
             for query, _, _, _ in amc.cases()}
    assert kinds == {(True, False), (False, True)}
