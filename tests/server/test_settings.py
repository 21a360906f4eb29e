"""ServerSettings is derived from config.ServeConfig (issue 34: it repeated its fields). The
derivation changed nothing: the defaults and field order recorded from the hand-written class
(commit 1b8610f), and the settings `tokenweir serve` builds from a parsed command line, equal
what the old code built (its expression kept below as `_old_settings`)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenweir.cli import build_parser
from tokenweir.config import ServeConfig
from tokenweir.server.settings import SHARED_FIELDS, ServerSettings

# dataclasses.asdict(ServerSettings()) of the hand-written class, in its field order.
RECORDED_DEFAULTS = {"served_model_names": (), "api_key": None, "max_waiting_requests": None,
                     "drain_timeout": 30.0, "max_request_body_bytes": 4194304,
                     "timeline_steps": 2000,
                     # issue 35's field, added beside the hand-written class (branch slo)
                     "slo_reject_hopeless": False}


def test_defaults_and_field_order_as_recorded():
    assert list(dataclasses.asdict(ServerSettings()).items()) == list(
        RECORDED_DEFAULTS.items())


def test_shared_fields_come_from_serve_config():
    serve = {f.name: f for f in dataclasses.fields(ServeConfig)}
    for f in dataclasses.fields(ServerSettings):
        if f.name in SHARED_FIELDS:
            assert f.default == serve[f.name].default and f.metadata == serve[f.name].metadata
    assert set(SHARED_FIELDS) | {"served_model_names"} == {
        f.name for f in dataclasses.fields(ServerSettings)}


def _old_settings(args, names, environ) -> ServerSettings:
    """server/cli.py's construction before the derivation, verbatim but for the environ."""
    return ServerSettings(
        served_model_names=names,
        api_key=args.api_key or environ.get("TOKENWEIR_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout,
        max_request_body_bytes=args.max_request_body_bytes, timeline_steps=args.timeline_steps,
        slo_reject_hopeless=args.slo_reject_hopeless)


@pytest.mark.parametrize("argv,env_key", [
    ([], None), ([], "from-env"), ([], ""), (["--api-key", "flag"], "from-env"),
    (["--max-waiting-requests", "3", "--drain-timeout", "0", "--max-request-body-bytes",
      "100", "--timeline-steps", "0", "--served-model-name", "a", "b"], None),
    (["--slo-reject-hopeless"], None),
])
def test_serve_builds_the_settings_the_old_code_built(argv, env_key, monkeypatch):
    if env_key is None:
        monkeypatch.delenv("TOKENWEIR_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TOKENWEIR_API_KEY", env_key)
    args = build_parser().parse_args(["serve", *argv])
    names = tuple(args.served_model_name or ()) or ("smollm2-135m",)
    import os
    assert ServerSettings.from_serve_args(args, names) == _old_settings(args, names, os.environ)


@pytest.mark.parametrize("bad", [{"max_request_body_bytes": 0}, {"drain_timeout": -1.0}])
def test_bad_values_are_still_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerSettings(**bad)
