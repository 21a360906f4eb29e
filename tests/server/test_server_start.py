"""The server stack's start-up imports: building the routes imports no `pydantic.v1` (FastAPI
imports it to check a `-> dict` route's response model), and the OpenAPI document of the
routes that return plain dicts is what `-> dict` published (tokenweir/server/routes.py:
_json_object). A fresh interpreter: this test process may have imported anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from tokenweir.server.routes import router

def document(r):
    app = FastAPI(title="tokenweir")
    app.include_router(r)
    return get_openapi(title=app.title, version=app.version, routes=app.routes)["paths"]

ours = document(router)
v1_after_ours = "pydantic.v1" in sys.modules
reference = APIRouter()  # the routes as they were declared before: `-> dict`

@reference.get("/profile")
async def profile() -> dict:
    return {}

@reference.get("/v1/models")
async def models() -> dict:
    return {}

theirs = document(reference)
print(json.dumps({"v1_after_ours": v1_after_ours, "v1_after_reference": "pydantic.v1" in sys.modules,
                  "ours": {p: ours[p]["get"]["responses"] for p in ("/profile", "/v1/models")},
                  "theirs": {p: theirs[p]["get"]["responses"] for p in ("/profile", "/v1/models")}}))
"""


def test_routes_import_no_pydantic_v1_and_publish_the_same_responses():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["v1_after_reference"]  # probe: a `-> dict` route does import pydantic.v1
    assert not result["v1_after_ours"]
    assert result["ours"] == result["theirs"]
    assert result["ours"]["/v1/models"]["200"]["content"]["application/json"]["schema"][
        "type"] == "object"  # probe: the comparison saw the schema


# Every attempt to import torch is recorded and refused (ModuleNotFoundError), so that no
# import of torch is paid for (~3 s of a fresh interpreter's CPU, and its exit): the API
# side's imports must make no attempt (a guarded `try: import torch` is caught too), and the
# engine side's must make one (the probe that attempts are seen).
API_SIDE = """
import importlib.abc, json, sys
attempts = []

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)")
        return None

sys.meta_path.insert(0, NoTorch())
import tokenweir.server.serve, tokenweir.server.cli, tokenweir.engine.core_client
without = not attempts and "torch" not in sys.modules
try:
    import tokenweir.engine.llm_engine  # probe: the engine side does try to import it
except ImportError:
    pass
print(json.dumps({"without": without, "probe": bool(attempts)}))
"""


def test_the_api_side_of_an_engine_process_server_imports_no_torch():
    """`serve --engine-process`: the API process (server stack, AsyncEngine, RemoteEngine,
    input processing) runs without torch, so its imports overlap the core's torch import.
    Run with torch refused (API_SIDE), so that the test pays for no torch import."""
    proc = subprocess.run([sys.executable, "-c", API_SIDE], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"without": True, "probe": True}
