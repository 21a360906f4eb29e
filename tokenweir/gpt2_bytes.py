"""GPT-2's byte <-> printable character map, shared by the tokenizer (model/tokenizer.py) and
the grammar vocabulary (guided/vocab.py) without either package importing the other's."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 upwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
