"""The router's /profile and /timeline when a replica is out (no model needed: the replica's
address refuses connections, so the router's first health check takes it out)."""

from __future__ import annotations

import socket

from fastapi.testclient import TestClient

from tokenweir.config import RouterConfig
from tokenweir.router.app import create_router_app


def closed_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_replica_that_is_out_answers_503_and_stands_as_an_error_in_every_profile():
    url = closed_url()
    app = create_router_app(RouterConfig(replicas=(url,), health_timeout=2.0))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503  # probe: the replica is out
        one = client.get("/profile?replica=0")
        assert one.status_code == 503 and one.json()["error"]["code"] == "replica_failed"
        assert url in one.json()["error"]["message"]
        every = client.get("/profile")
        assert every.status_code == 200
        assert every.json()["replicas"][url]["error"]["code"] == "replica_failed"
        page = client.get("/timeline")  # one replica: its page is relayed, here its failure
        assert page.status_code == 503
        unknown = client.get(f"/timeline?replica={url}/other")
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "replica"
