"""README.md's map ("How it works") names every module of the package, in the entry of the
folder it lies in (issue 34: ~25 files were missing, cli/parser.py and server/settings.py
among them). A new module fails here until the map says what it is."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def map_sections() -> dict[str, str]:
    """The map's text per top-level entry: '' for the package's own files (config.py, ...),
    'core', 'sim', ... for a folder's lines (its entry and the lines indented under it)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## How it works\n\n```\ntokenweir/\n(.*?)```", readme, re.S).group(1)
    sections: dict[str, list[str]] = {}
    current = ""
    for line in block.splitlines():
        entry = re.match(r"^  (\S+)", line)
        if entry:
            name = entry.group(1)
            current = name.split("/")[0] if "/" in name else ""
        sections.setdefault(current, []).append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def unmapped_modules() -> list[str]:
    sections = map_sections()
    missing = []
    for path in sorted((ROOT / "tokenweir").rglob("*.py")):
        rel = path.relative_to(ROOT / "tokenweir")
        if path.name == "__init__.py":
            continue
        text = sections.get(rel.parts[0] if len(rel.parts) > 1 else "", "")
        if not re.search(r"(?<![\w.])" + re.escape(path.name), text):
            missing.append(str(rel))
    return missing


def test_the_map_names_every_module():
    assert len(map_sections()) > 10  # probe: the map was found and split into its entries
    assert unmapped_modules() == []


def test_a_module_the_map_does_not_name_is_found(tmp_path, monkeypatch):
    """Probe: the check sees an unnamed module (a copy of the tree with one more file)."""
    import shutil

    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "tokenweir", tmp_path / "tokenweir",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cpp", "*.h"))
    (tmp_path / "tokenweir" / "sim" / "brand_new.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unmapped_modules() == ["sim/brand_new.py"]
