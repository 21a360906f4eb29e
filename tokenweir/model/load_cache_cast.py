"""The load cache's weights in the model's dtype, so that a bfloat16 start maps them instead of
converting the entry's float32 copy.

The load cache entry (model/load_cache.py) holds the weights in float32: a float32 model adopts
them as they are, mapped. A bfloat16 model (the `dtype auto` choice on a CPU with AVX-512 BF16
or AMX) copied and rounded all 135M of SmolLM2-135M's values on every start: the `weights`
phase took 0.15-0.25 s there against 0.03 s in float32 (benchmarks/startup.py, warm, exclusive,
Intel Xeon with AMX). `weights_in` writes the rounded copy into the entry once and maps it on
later starts:

    <entry>/cast-<bf16|f16>-<tag[:12]>.safetensors   every cast tensor, in the entry's order
    <entry>/cast-<bf16|f16>-<tag[:12]>.json          its size and words checksum (written last)

Contracts:
* **The same values as the conversion it replaces.** A tensor is cast with `Tensor.to(dtype)`,
  the rounding `load_weights`' `copy_` applies; what is not a model parameter (the GGUF's
  `rope_freqs`, kept in float32 by the rotary table) is not cast and still comes from the
  entry's float32 file.
* **Keyed by the entry, the dtype and the code.** The entry directory names the source file
  and the code that derived its float32 weights; the side file names that directory too
  (a file moved from another entry is refused). The file name holds the dtype, and the tag
  hashes CAST_FORMAT, the dtype, torch's version and this module's source; the header's dtype
  and every tensor's name and shape are checked against the float32 entry's on each read, so
  a file for another dtype, model or entry is never used. Files of other tags of the same
  dtype are removed when one is written.
* **Checked on every read** like the entry: a side file that does not parse, a size or words
  checksum that differs, or a header that is not the expected one is said on stderr; the files
  are removed and written again from the float32 weights. model/prefetch.py checks the file's
  checksum while torch imports, as for the entry's own weights.
* **Where it applies**: a CPU model of a dtype in CAST_DTYPES built from a load cache entry.
  TOKENWEIR_CAST_CACHE=0 turns off only this part (to measure what it saves).

Measured (benchmarks/startup.py --cache-dir, warm, bfloat16, Intel Xeon with AMX, exclusive
lock, 5 interleaved pairs, 50a3dc4 then this): `weights` 0.14-0.18 s -> 0.01-0.02 s in every
run; generate ready 2.15/2.51/1.94/2.15/1.88 s -> 1.86/1.78/1.73/2.27/1.73 s; serve /health
1.93/2.71/2.29/2.20/2.13 s -> 2.07/2.38/1.66/1.98/1.65 s.
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Iterator, Optional

import torch

from tokenweir.model import load_cache
from tokenweir.model.load_cache import CacheCorrupt, notice

CAST_FORMAT = 1  # bump when the file's layout or meaning changes
CAST_DTYPES = {torch.bfloat16: ("bf16", "BF16"), torch.float16: ("f16", "F16")}
_NOT_PARAMETERS = ("rope_freqs",)  # entry tensors the model keeps in float32 (not cast)

Weights = list[tuple[str, torch.Tensor]]


def applies(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in CAST_DTYPES
            and os.environ.get("TOKENWEIR_CAST_CACHE", "1") != "0")


def cast_tag(dtype: torch.dtype) -> str:
    """Hex digest of what besides the entry shapes the cast file (module contract)."""
    digest = hashlib.sha256(f"cast {CAST_FORMAT} {dtype} torch {torch.__version__}".encode())
    with open(os.path.abspath(__file__), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def stem_for(entry: str, dtype: torch.dtype) -> str:
    return os.path.join(entry, f"cast-{CAST_DTYPES[dtype][0]}-{cast_tag(dtype)[:12]}")


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return name not in _NOT_PARAMETERS and tensor.dtype == torch.float32


def weights_in(entry: str, weights: Weights, dtype: torch.dtype) -> tuple[Weights, str]:
    """`weights` (the entry's float32 views, in its order) with every parameter tensor replaced
    by its `dtype` copy mapped from the entry's cast file, written there first when missing or
    damaged; and what happened: "hit", "written" or "rebuilt". OSError when the entry cannot
    take the file (the caller then converts as without it)."""
    stem = stem_for(entry, dtype)
    wanted = [(name, tuple(t.shape)) for name, t in weights if _cast(name, t, dtype)]
    status = "written"
    try:
        mapped = _read(stem, wanted, dtype, entry)
        if mapped is not None:
            return _merge(weights, mapped, dtype), "hit"
    except CacheCorrupt as exc:
        notice(f"{os.path.basename(stem)}.safetensors in {entry} is unusable ({exc}); "
               "casting the weights again")
        _remove(stem)
        status = "rebuilt"
    _write(stem, wanted, weights, dtype, entry)
    mapped = _read(stem, wanted, dtype, entry)  # checked like any other read
    if mapped is None:
        raise CacheCorrupt(f"the cast weights {stem}.json vanished right after writing")
    _remove_other_tags(entry, dtype, os.path.basename(stem))
    return _merge(weights, mapped, dtype), status


def _merge(weights: Weights, mapped: list[torch.Tensor], dtype: torch.dtype) -> Weights:
    casts = iter(mapped)
    return [(name, next(casts) if _cast(name, t, dtype) else t) for name, t in weights]


def _read(stem: str, wanted: list, dtype: torch.dtype,
          entry: str) -> Optional[list[torch.Tensor]]:
    """The mapped tensors, None when there is no (finished) file; CacheCorrupt when one is
    there but fails a check."""
    checked = load_cache.read_checked_file(stem)
    if checked is None:
        return None
    meta, buffer = checked
    written_for = meta.get("entry")
    if written_for != os.path.basename(os.path.normpath(entry)):
        raise CacheCorrupt(f"written for the entry {written_for!r}, not this one")
    tensors = load_cache.read_weights(buffer, CAST_DTYPES[dtype][1])
    if [(name, tuple(t.shape)) for name, t in tensors] != wanted:
        raise CacheCorrupt("its tensors are not the entry's")
    return [t for _, t in tensors]


def _write(stem: str, wanted: list, weights: Weights, dtype: torch.dtype, entry: str) -> None:
    """Cast each tensor and stream it into <stem>.safetensors (one cast copy in memory at a
    time), then the side file (load_cache.write_checked_file)."""
    def cast() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if _cast(name, tensor, dtype):
                yield name, tensor.to(dtype)

    meta = {"format": CAST_FORMAT, "dtype": str(dtype),
            "entry": os.path.basename(os.path.normpath(entry))}
    load_cache.write_checked_file(
        stem, lambda path: load_cache.write_weights(path, wanted, cast(), CAST_DTYPES[dtype][1]),
        meta)


_remove = load_cache.remove_checked_file


def _remove_other_tags(entry: str, dtype: torch.dtype, own: str) -> None:
    """Cast files of this dtype by other code are never read again."""
    for path in glob.glob(os.path.join(entry, f"cast-{CAST_DTYPES[dtype][0]}-*")):
        name = os.path.basename(path)
        if not name.startswith(own) and ".tmp-" not in name:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
