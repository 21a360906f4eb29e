"""The model's vocabulary as bytes: what a grammar library needs to know of our tokenizer.

A grammar matcher decides which tokens may come next by the bytes each token spells, so it
needs, for every token id, the exact bytes the token adds to the text, and which ids are
special (control tokens such as `<|im_end|>`, which spell no text and which the grammar never
produces, except the stop tokens at the end).

Two spellings are understood, read from the tokenizer's own decoder:
- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): every character of a token stands for one
  byte through GPT-2's reversible byte <-> printable character map;
- sentencepiece-style (Llama 2, Mistral): `▁` is a space and `<0xAB>` tokens are raw bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tokenweir.gpt2_bytes import byte_to_unicode

if TYPE_CHECKING:  # guided/ uses the tokenizer it is handed; model/ imports guided/masks
    from tokenweir.model.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"


@dataclass(frozen=True)
class Vocabulary:
    """`token_bytes[i]` is what token i spells (b"" for special tokens); `special_ids` are the
    control tokens (`special_names` their text, where the tokenizer has one); `stop_ids` the
    ones that end a generation (the model's EOS ids); `encode` tokenizes text without
    special tokens."""

    token_bytes: list[bytes]
    special_ids: frozenset[int]
    stop_ids: frozenset[int]
    special_names: dict[int, str]
    encode: Callable[[str], list[int]]

    @property
    def size(self) -> int:
        return len(self.token_bytes)


def vocabulary_of(tokenizer: Tokenizer, vocab_size: int) -> Vocabulary:
    """The bytes of every token of `tokenizer`, padded with unreachable ids up to the model's
    `vocab_size` (a model's embedding may be wider than its tokenizer; those ids stay special,
    so no grammar ever allows them)."""
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    byte_level = _is_byte_level(spec.get("decoder"))
    special = {added["id"] for added in spec.get("added_tokens", []) if added.get("special")}
    token_bytes: list[bytes] = []
    for token_id in range(vocab_size):
        token = backend.id_to_token(token_id) if token_id < tokenizer.vocab_size else None
        if token is None:
            special.add(token_id)
        if token is None or token_id in special:
            token_bytes.append(b"")
        elif byte_level:
            token_bytes.append(_byte_level_bytes(token))
        else:
            token_bytes.append(_sentencepiece_bytes(token))
    names = {i: backend.id_to_token(i) for i in special if i < tokenizer.vocab_size}
    return Vocabulary(token_bytes, frozenset(special), frozenset(tokenizer.eos_token_ids),
                      {i: n for i, n in names.items() if n}, _encoder(tokenizer))


def _encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    return encode


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", []) or [])


def _byte_level_bytes(token: str) -> bytes:
    to_byte = _unicode_to_byte()
    if all(ch in to_byte for ch in token):
        return bytes(to_byte[ch] for ch in token)
    return token.encode("utf-8")  # an added (non-special) token stored as plain text


def _sentencepiece_bytes(token: str) -> bytes:
    match = _BYTE_TOKEN.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(_METASPACE, " ").encode("utf-8")


_INVERSE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    if not _INVERSE:
        _INVERSE.update({ch: b for b, ch in byte_to_unicode().items()})
    return _INVERSE
