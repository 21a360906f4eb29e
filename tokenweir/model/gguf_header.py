"""Read a few scalar keys of a GGUF file's metadata without gguf-py and without reading the
rest: `gguf.GGUFReader` parses every key (SmolLM2: 98k tokenizer strings, seconds), while a
pre-load check needs only the architecture and the context length, which llama.cpp writes
before the tokenizer. Torch-free, numpy-free.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key count,
then per key: string key, u32 value type, value; a string is a u64 length and UTF-8 bytes; an
array is u32 item type, u64 count, items.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO, Iterable

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class NotGGUF(ValueError):
    """The file is not a GGUF this reader understands."""


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise NotGGUF("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    data = f.read(length)
    if len(data) != length:
        raise NotGGUF("the file ends inside its metadata")
    return data.decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    """The value of type `kind` at the file position (arrays are skipped: None)."""
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _value(f, item, keep=False)
        return None
    raise NotGGUF(f"unknown GGUF value type {kind}")


def read_scalars(path: str, wanted: Iterable[str]) -> dict[str, Any]:
    """{key: value} for the keys of `wanted` that the file's metadata holds (scalars and
    strings), reading only as far as the last of them; NotGGUF for anything else."""
    wanted, found = set(wanted), {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise NotGGUF(f"{path} is not a GGUF file (bad magic)")
        if _read(f, "<I") not in (2, 3):
            raise NotGGUF(f"{path}: unsupported GGUF version")
        _read(f, "<Q")
        for _ in range(_read(f, "<Q")):
            key, kind = _string(f), _read(f, "<I")
            value = _value(f, kind, keep=key in wanted)
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def context_length(path: str) -> int:
    """The model's context length (`<architecture>.context_length`; 2048 when absent, as
    ArchConfig.from_gguf_metadata reads it)."""
    arch = read_scalars(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        raise NotGGUF(f"{path} names no general.architecture")
    value = read_scalars(path, [f"{arch}.context_length"]).get(f"{arch}.context_length")
    return int(value) if value is not None else 2048
