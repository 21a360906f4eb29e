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

Why Triton and not FlexAttention (measured on the 2-core AVX2 CI machine, torch 2.13 CPU, other
jobs running): FlexAttention runs on CPU only through torch.compile, and its first call on ONE
tiny causal shape (1 x 4 heads x 128 x 64) took 98.6 s to compile (0.03 s after); every new
step shape (query count, block-table width) risks another compile, and its block mask is built
per step from the block tables. Triton's interpreter ran the whole kernel test file (39 cases:
decodes, chunks after cached prefixes, GQA/MHA/MQA, block sizes 1-48, bfloat16) in 28 s with
no compile, and on CUDA the same kernel is one launch whose grid depends only on the tile count
(CUDA-graph friendly). triton 3.9.0 on CPU; the H200 seen had triton 3.6.
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
