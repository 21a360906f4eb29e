"""Attention backends: the one seam through which a step's attention runs.

A backend attends the whole flattened step (decodes and prefill chunks together) for one layer:

    backend.forward(q [T, H, D], k [T, KVH, D], v [T, KVH, D], kv_cache, meta, scale) -> [T, H, D]

It first writes k/v into the layer's cache at `meta.slot_mapping`, then reads each request's
context from its blocks (`meta.block_tables`, `meta.seq_lens`, `meta.query_start_loc`, see
tokenweir/model/attention.py for the cache and metadata contract). Anything it derives from the
metadata (tile tables, masks) it builds once per step, at the first layer, and keeps on the
metadata (`meta.backend_plan`): the other layers only launch.

The runner picks a backend once (`select_backend`) and hands it to every step's metadata; the
model never decides. Backends:

* `cpu`: the existing path of attention.py: the C++ in-place kernels on CPU (float32 /
  bfloat16), else batched SDPA over gathered blocks. The default on CPU.
* `triton`: one Triton kernel launch per layer for the whole step, reading K/V blocks in place
  (backends/triton_paged.py). The default on CUDA when triton imports. Runs on CPU only under
  `TRITON_INTERPRET=1` (the tests use that).
* `reference`: one SDPA per request over its gathered blocks with an explicit causal mask:
  slow, simple, the yardstick the others are tested against.

`TOKENWEIR_ATTENTION_BACKEND` (auto | cpu | triton | reference) overrides the choice.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Protocol

import torch

ENV = "TOKENWEIR_ATTENTION_BACKEND"
NAMES = ("cpu", "triton", "reference")


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
        """See the module docstring."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(device: torch.device | str, name: Optional[str] = None
                   ) -> Optional[AttentionBackend]:
    """The backend for a runner on `device`: `name`, else $TOKENWEIR_ATTENTION_BACKEND, else
    auto (triton on CUDA when installed, else the cpu path). Returns None for the cpu path
    (attention.py's own, which is what metadata without a backend runs)."""
    device = torch.device(device)
    name = (name or os.environ.get(ENV) or "auto").lower()
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "cpu"
    if name == "cpu":
        return None
    if name == "reference":
        from tokenweir.model.backends.reference import ReferenceBackend
        return ReferenceBackend()
    if name == "triton":
        from tokenweir.model.backends.triton_paged import TritonBackend
        return TritonBackend.for_device(device)
    raise ValueError(f"unknown attention backend {name!r} (one of auto, {', '.join(NAMES)})")
