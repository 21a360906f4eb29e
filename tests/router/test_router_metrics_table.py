"""The router's /metrics text is unchanged by router/metrics.py's table of families: the
exposition of two replicas' texts plus the router's own families, compared with the text the
hand-written families produced (data/router_metrics.txt, recorded on 099688c, before the
table)."""

from __future__ import annotations

from pathlib import Path

from tokenweir.router.metrics import ROUTER_FAMILIES, exposition
from tokenweir.router.replicas import Replica

RECORDED = Path(__file__).parent / "data" / "router_metrics.txt"

_REPLICA_TEXT = """\
# HELP tokenweir:num_requests_running Requests in the running batch.
# TYPE tokenweir:num_requests_running gauge
tokenweir:num_requests_running{model_name="m"} {running}
# HELP tokenweir:prompt_tokens_total Prompt tokens processed.
# TYPE tokenweir:prompt_tokens_total counter
tokenweir:prompt_tokens_total{model_name="m"} {prompt}
# HELP tokenweir:time_to_first_token_seconds Time to first token.
# TYPE tokenweir:time_to_first_token_seconds histogram
tokenweir:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
tokenweir:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} {prompt}
tokenweir:time_to_first_token_seconds_count{model_name="m"} {prompt}
tokenweir:time_to_first_token_seconds_sum{model_name="m"} 0.5
"""


def replica_texts() -> list[tuple[str, str]]:
    return [(url, _REPLICA_TEXT.replace("{running}", str(running))
             .replace("{prompt}", str(prompt)))
            for url, running, prompt in (("http://a:1", 2, 30), ("http://b:2", 0, 12))]


def replicas() -> list[Replica]:
    """One replica up with flights, counts and a reported load; one out."""
    up = Replica(0, "http://a:1", up=True, running=2, waiting=1, kv_usage=0.25, routed=7,
                 failed=1, taken_out=2)
    up.flights = {object(), object(), object(), object()}
    return [up, Replica(1, "http://b:2", up=False, routed=3, taken_out=1)]


def test_the_metrics_text_is_the_one_recorded_before_the_table():
    text = exposition(replica_texts(), replicas(), retries=5).decode()
    assert text == RECORDED.read_text()


def test_the_recorded_text_has_every_router_family_and_both_replicas():
    """Probe that the comparison covers what the table makes: each family of the table, with
    a sample per replica (the retries counter: one), and the replicas' merged families."""
    text = RECORDED.read_text()
    for family in ROUTER_FAMILIES:
        exposed = family.name + ("_total" if family.kind == "counter" else "")
        assert f"# TYPE tokenweir:router_{exposed} {family.kind}" in text
    assert text.count('tokenweir:router_routed_total{replica="http://b:2"} 3.0') == 1
    assert 'tokenweir:router_in_flight{replica="http://a:1"} 4.0' in text
    assert 'tokenweir:router_replica_load{replica="http://a:1"} 4.25' in text
    assert 'tokenweir:router_retries_total 5.0' in text
    assert 'prompt_tokens_total{model_name="m",replica="http://b:2"} 12.0' in text
