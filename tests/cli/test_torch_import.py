"""tokenweir/torch_import.py: `import torch` with the cheap get_source records the same
"FILE:LINE" for every operator torch registers as the real one does, and the replacement did
happen (probe). Each run is a fresh interpreter: the finder acts only before torch's import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tokenweir import torch_import

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
if sys.argv[1] == "on":
    from tokenweir import torch_import
    assert torch_import.install()
import torch
import torch._library.simple_registry as registry
from tokenweir import torch_import
sources = {name: entry.fake_impl.kernel.source for name, entry in registry.singleton._data.items()
           if entry.fake_impl.kernel is not None}
print(json.dumps({"sources": sources,
                  "replaced": torch._library.utils.get_source is torch_import._get_source,
                  "finder_left": torch_import._finder in sys.meta_path,
                  "installs_again": torch_import.install()}))
"""


def _run(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("TOKENWEIR_FAST_TORCH_IMPORT", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_cheap_get_source_records_what_torchs_own_does():
    real, cheap = _run("off"), _run("on")
    assert cheap["replaced"] and not real["replaced"]  # probe: the replacement happened
    assert not cheap["finder_left"] and not cheap["installs_again"]  # torch imported: no-op
    assert len(real["sources"]) > 50  # probe: torch registered through get_source
    assert cheap["sources"] == real["sources"]


def test_get_source_names_the_callers_line():
    def caller():
        return torch_import._get_source(1), sys._getframe().f_lineno

    source, line = caller()
    assert source == f"{__file__}:{line}"


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENWEIR_FAST_TORCH_IMPORT", "0")
    assert not torch_import.install()
    assert torch_import._finder not in sys.meta_path
