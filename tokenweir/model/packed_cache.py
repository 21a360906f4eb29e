"""Packed float32 weights in the load cache, so that a warm start does not pack them again.

On CPU in float32 the few-rows matmuls run on weights packed into panels (model/layers.py,
PACK_LINEAR; kernels.pack_linear_weight): every Linear weight of the model and the LM head,
packed once in the process at its first matmul. For SmolLM2-135M that is 540 MB written, about
1 s of every start's first forward. `attach` (called by the loader right after a load the load
cache served) writes those panels into the cache entry once and maps them on later starts:

    <entry>/packed-<tag[:12]>.safetensors   the panels, one tensor per packed weight
    <entry>/packed-<tag[:12]>.json          their size and words checksum (written last)

Contracts:
* **Keyed by the entry and by the packing code.** The entry directory already names the source
  file and the code that derived its weights (model/load_cache.py). The tag adds PACKED_FORMAT,
  the kernel's instruction set and panel width, and the source text of the modules that decide
  what is packed and how: llama.py (which rows the fused qkv / gate_up weights hold), layers.py
  and kernels/__init__.py (the packing), kernels/linear_impl.h (the layout the kernel reads).
  Files of other tags in the entry are removed when one is written.
* **Only for weights exactly as the entry gave them.** The loader calls `attach` right after it
  built the model, before anything can write to it; each panel set is installed under the key
  `layers.packed_weight` checks (storage, version, shape, panel width), so a later in-place
  write to a weight repacks it as before.
* **Checked on every read**, like the entry: a JSON side file that does not parse, a size or
  checksum that differs, or a header whose names and shapes are not what this model packs is
  said on stderr; the files are removed and written again from the model's weights.
* **Where it applies**: CPU float32 with the packed kernel available (TOKENWEIR_PACK_LINEAR on,
  the C++ kernels built and enabled). Elsewhere nothing is read or written. The load cache's off
  switch (TOKENWEIR_LOAD_CACHE=0) turns this off with it (there is then no entry);
  TOKENWEIR_PACKED_CACHE=0 turns off only this part (to measure what it saves).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterator, Optional

import torch

from tokenweir.model import kernels, layers, load_cache
from tokenweir.model.load_cache import CacheCorrupt, notice

PACKED_FORMAT = 1  # bump when the file's layout or meaning changes
_DERIVING_FILES = ("llama.py", "layers.py", os.path.join("kernels", "__init__.py"),
                   os.path.join("kernels", "linear_impl.h"))
_LM_HEAD = "lm_head"  # the model's own slot: compute_logits packs lm_head_weight on the model


def packing_tag(isa: str, panel: int) -> str:
    """Hex digest of everything besides the entry that shapes the panels (module contract)."""
    digest = hashlib.sha256(f"packed {PACKED_FORMAT} {isa} {panel}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _DERIVING_FILES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def targets(model: Any) -> list[tuple[str, Any, torch.Tensor]]:
    """(name, owner, weight) of every weight the float32 packed kernel packs, in a fixed order:
    each Linear of the decoder (its own slot), then the LM head weight (the model's slot, as
    compute_logits packs it; an untied lm_head module's forward is never called)."""
    out = [(f"{name}.weight", module, module.weight)
           for name, module in model.model.named_modules() if isinstance(module, layers.Linear)]
    out.append((_LM_HEAD, model, model.lm_head_weight))
    return out


def applies(model: Any) -> Optional[Any]:
    """The packed kernel when `model` would use packed float32 weights, else None."""
    weight = model.lm_head_weight
    if os.environ.get("TOKENWEIR_PACKED_CACHE", "1") == "0":
        return None
    if not layers.PACK_LINEAR or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return kernels.packed_linear_kernel()


def attach(model: Any, entry: str) -> str:
    """Install the packed weights of `model` (just built from the load cache entry `entry`)
    from the entry, writing them there first when missing or damaged. Returns what happened:
    "hit", "written", "rebuilt", or "" (does not apply: see the module contract)."""
    kernel = applies(model)
    if kernel is None:
        return ""
    tag = packing_tag(kernel.isa, kernel.panel)[:12]
    stem = os.path.join(entry, f"packed-{tag}")
    wanted = targets(model)
    status = "written"
    try:
        panels = _read(stem, wanted, kernel.panel)
        if panels is not None:
            _install(wanted, panels, kernel.panel)
            return "hit"
    except CacheCorrupt as exc:
        notice(f"packed weights {stem}.safetensors are unusable ({exc}); packing them again")
        _remove(stem)
        status = "rebuilt"
    _write(stem, wanted, kernel.panel)
    panels = _read(stem, wanted, kernel.panel)  # checked like any other read
    if panels is None:
        raise CacheCorrupt(f"the packed weights {stem}.json vanished right after writing")
    _install(wanted, panels, kernel.panel)
    _remove_other_tags(entry, os.path.basename(stem))
    return status


def _shape(weight: torch.Tensor, panel: int) -> tuple[int, int, int]:
    n, k = weight.shape
    return (-(-n // panel), k, panel)  # kernels.pack_linear_weight's layout


def _install(wanted, panels: list[torch.Tensor], panel: int) -> None:
    for (_, owner, weight), packed in zip(wanted, panels, strict=True):
        layers.install_packed_weight(owner, weight, panel, packed)


def _read(stem: str, wanted, panel: int) -> Optional[list[torch.Tensor]]:
    """The mapped panels, None when there is no (finished) file; CacheCorrupt when one is
    there but fails a check."""
    checked = load_cache.read_checked_file(stem)
    if checked is None:
        return None
    _, buffer = checked
    tensors = load_cache.read_weights(buffer)
    expected = [(name, _shape(weight, panel)) for name, _, weight in wanted]
    if [(name, tuple(t.shape)) for name, t in tensors] != expected:
        raise CacheCorrupt("its tensors are not the ones this model packs")
    return [t for _, t in tensors]


def _write(stem: str, wanted, panel: int) -> None:
    """Pack each weight and stream it into <stem>.safetensors (one packed copy in memory at a
    time), then the side file (load_cache.write_checked_file)."""
    specs = [(name, _shape(weight, panel)) for name, _, weight in wanted]

    def packed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, _, weight in wanted:
            yield name, kernels.pack_linear_weight(weight.detach(), panel)

    load_cache.write_checked_file(
        stem, lambda path: load_cache.write_weights(path, specs, packed()),
        {"format": PACKED_FORMAT})


_remove = load_cache.remove_checked_file


def _remove_other_tags(entry: str, own: str) -> None:
    """Packed files of other tags (older code, another instruction set) are never read again."""
    for name in os.listdir(entry):
        if name.startswith("packed-") and not name.startswith(own) and ".tmp-" not in name:
            try:
                os.remove(os.path.join(entry, name))
            except FileNotFoundError:
                pass
