"""Tokenizer wrapper over a `tokenizers.Tokenizer`, plus incremental detokenization.

Sources:
* a Hugging Face directory with `tokenizer.json` (+ `tokenizer_config.json` for the chat
  template, BOS/EOS): loaded directly with `tokenizers`, no transformers import;
* a GGUF file whose vocabulary is byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the
  default GPT-2 split (SmolLM2 and friends): built from the metadata, the same way transformers
  builds it, in well under a second;
* anything else (sentencepiece-only directories, other GGUF tokenizer kinds): delegated to
  transformers' `AutoTokenizer` (offline), whose Rust backend is then wrapped.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Mapping, Optional, Sequence

from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from tokenweir.gpt2_bytes import byte_to_unicode

# GGUF pre-tokenizer names that use the plain GPT-2 split regex (ByteLevel's own regex).
_GPT2_SPLIT_PRE = (None, "default", "gpt-2", "gpt2", "smollm")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """Compile a chat template the way HF renders them (sandboxed, trim/lstrip blocks)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (e.g. `messages`, `tools`)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(meta.find_undeclared_variables(env.parse(source)))


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> ids for one model.

    `encode` adds exactly the special tokens the model's own tokenizer adds (SmolLM2: none).
    `decode` never applies `clean_up_tokenization_spaces`, so streamed deltas (see
    IncrementalDetokenizer) concatenate to exactly `decode(all_ids)`.
    """

    def __init__(self, backend: RustTokenizer, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, extra_eos_ids: Iterable[int] = (),
                 chat_template: Optional[str] = None, add_bos: Optional[bool] = None,
                 special_tokens: Optional[Mapping[str, str]] = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        eos = {self.eos_token_id, *extra_eos_ids} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(int(e) for e in eos)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._bos_fix = self._bos_correction(add_bos)

    def _bos_correction(self, add_bos: Optional[bool]) -> Optional[str]:
        """'add' / 'strip' when the backend's post-processor disagrees with an explicit
        add_bos_token setting, else None."""
        if add_bos is None or self.bos_token_id is None:
            return None
        adds = self.backend.encode("a").ids[:1] == [self.bos_token_id]
        if add_bos and not adds:
            return "add"
        if adds and not add_bos:
            return "strip"
        return None

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """Load from a Hugging Face model directory (tokenizer.json preferred)."""
        cfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        gen = _read_json(os.path.join(path, "generation_config.json")) or {}
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        tok_json = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_json):
            return cls._from_transformers(path, None, template)
        extra_eos = gen.get("eos_token_id")
        if not isinstance(extra_eos, list):
            extra_eos = [] if extra_eos is None else [extra_eos]
        specials = {k: _token_content(cfg.get(k)) for k in
                    ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(RustTokenizer.from_file(tok_json),
                   bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                   extra_eos_ids=extra_eos, chat_template=template,
                   add_bos=cfg.get("add_bos_token"), special_tokens=specials)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], gguf_path: str) -> "Tokenizer":
        """Build from GGUF metadata (decoded values incl. `tokenizer.ggml.tokens`, `merges`,
        `token_type`). Byte-level BPE with the GPT-2 split is built here; other kinds are
        delegated to transformers (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`)."""
        kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
        template = meta.get("tokenizer.chat_template")
        if kind != "gpt2" or pre not in _GPT2_SPLIT_PRE or "tokenizer.ggml.merges" not in meta:
            return cls._from_transformers(os.path.dirname(gguf_path),
                                          os.path.basename(gguf_path), template)
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        backend = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"],
                                  meta.get("tokenizer.ggml.token_type") or [])

        def tok(key: str) -> Optional[str]:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        specials = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
                    "pad_token": tok("padding_token_id"), "unk_token": tok("unknown_token_id")}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        if add_bos and specials["bos_token"]:
            bos = specials["bos_token"]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokens.index(bos))])
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id",) if k in meta]
        return cls(backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                   extra_eos_ids=extra, chat_template=template, special_tokens=specials)

    def to_cache(self) -> tuple[str, dict[str, Any]]:
        """(backend JSON, wrapper fields): what `from_cache` rebuilds this tokenizer from,
        identically (model/load_cache.py stores it)."""
        fields = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                  "eos_token_ids": sorted(self.eos_token_ids),
                  "chat_template": self.chat_template, "special_tokens": self.special_tokens,
                  "bos_fix": self._bos_fix}
        return self.backend.to_str(), fields

    @classmethod
    def from_cache(cls, backend_json: str, fields: Mapping[str, Any]) -> "Tokenizer":
        """The tokenizer `to_cache` described."""
        tokenizer = cls(RustTokenizer.from_str(backend_json), bos_token=fields["bos_token"],
                        eos_token=fields["eos_token"], extra_eos_ids=fields["eos_token_ids"],
                        chat_template=fields["chat_template"],
                        special_tokens=fields["special_tokens"])
        tokenizer._bos_fix = fields["bos_fix"]
        return tokenizer

    @classmethod
    def _from_transformers(cls, folder: str, gguf_file: Optional[str],
                           template: Optional[str]) -> "Tokenizer":
        """Fallback: let transformers build it (offline), wrap its Rust backend."""
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer in {folder!r} has no fast (Rust) backend")
        specials = {k: getattr(hf, k, None) for k in
                    ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                   chat_template=template or getattr(hf, "chat_template", None),
                   special_tokens=specials)

    # ---- text <-> ids -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the model's own BOS convention when add_special_tokens."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos_fix == "add" and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        elif add_special_tokens and self._bos_fix == "strip" and ids[:1] == [self.bos_token_id]:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[Optional[str]]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (so it can render tool
        definitions, as Hermes / Qwen / Llama 3.1 templates do)."""
        return bool(self.chat_template) and "tools" in _template_variables(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Optional[Sequence[Mapping[str, Any]]] = None,
                            **kwargs: Any) -> str:
        """Render the model's own Jinja chat template. ValueError when the model has none, or
        when `tools` are given and the template does not take them."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if tools is not None:
            if not self.chat_template_takes_tools:
                raise ValueError("this model's chat template does not take tools")
            kwargs["tools"] = list(tools)
        variables = {**self.special_tokens, **kwargs}
        return _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str],
                    token_types: Sequence[int]) -> RustTokenizer:
    """A GPT-2 style byte-level BPE `tokenizers.Tokenizer` from a GGUF vocabulary: control tokens
    become special added tokens, user-defined ones plain added tokens."""
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        if not set(tok) <= alphabet:  # stored as raw text: respell in the byte alphabet
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, idx)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = RustTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None,
                                continuing_subword_prefix="", end_of_word_suffix="",
                                fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types)
               if kind == _GGUF_CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False)  # only those spelled as in vocab
            for t, kind in zip(tokens, token_types) if kind == _GGUF_USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return backend


def _decode_stream(tokenizer: Tokenizer, context: list[int], skip_special_tokens: bool):
    """A tokenizers DecodeStream primed with `context` (as already emitted), or None where
    the library has none (tokenizers < 0.22), the backend is not a Rust tokenizer, or the
    context ends inside a character (the stream would emit the context again)."""
    try:
        from tokenizers.decoders import DecodeStream
        if not isinstance(tokenizer.backend, RustTokenizer):
            return None
        if context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            return None
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class IncrementalDetokenizer:
    """Streams text for token ids fed one (or a few) at a time.

    Keeps a small window: `prefix_offset` .. `read_offset` is text already emitted (decoded
    again only as context, so tokenizers that drop a leading space at the start of a decode
    still produce it), tokens after `read_offset` are pending. A delta is emitted only when
    the decoded window grew and does not end in U+FFFD (an incomplete UTF-8 sequence split
    across tokens); then the window slides forward. Cost per token is O(window), not O(text).
    The deltas concatenate to `tokenizer.decode(all_ids)` (use `flush()` at the end).

    One token at a time (the engine's case), the same window runs in Rust: the tokenizers
    library's DecodeStream, which emits the same delta at the same token (2.0 vs 7.3 us per
    token for SmolLM2 on the 2-core AVX2 machine; tests/model/test_detokenizer_stream.py
    compares the two on random and natural ids). The offsets above are kept in step with it, so
    `flush()` and a later multi-token add (which switches this request to the Python window
    for good) continue exactly where the stream stood.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, context_tokens: int = 5) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-context_tokens:] if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._chunks: list[str] = []
        self._stream = _decode_stream(tokenizer, self.ids, skip_special_tokens)

    def _decode(self, start: int, end: Optional[int] = None) -> str:
        return self.tokenizer.decode(self.ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: Iterable[int] | int) -> str:
        """Feed new ids; return the newly completed text (possibly "")."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        new = [int(t) for t in token_ids]
        if self._stream is not None and len(new) == 1:
            return self._stream_one(new[0])
        self._stream = None  # several at once: the Python window from here on
        self.ids.extend(new)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._drop_consumed()
        self._chunks.append(delta)
        return delta

    def add_each(self, token_ids: Sequence[int]) -> str:
        """Feed ids one at a time, exactly as `add_tokens(t)` for each t in order would (same
        stream calls, same window and offsets after), and return their deltas joined: how a
        deferred request's text catches up (engine/output_processor.py)."""
        if self._stream is None:
            return "".join([self.add_tokens(t) for t in token_ids])
        step, backend, ids, parts = self._stream.step, self.tokenizer.backend, self.ids, []
        for token_id in token_ids:
            ids.append(token_id)
            delta = step(backend, token_id)
            if delta:  # the window slides as in _stream_one; the dropping waits for the end
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                parts.append(delta)
        self._drop_consumed()
        self._chunks += parts
        return "".join(parts)

    def _stream_one(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._stream.step(self.tokenizer.backend, token_id)
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._drop_consumed()
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is still pending (e.g. a trailing incomplete character as U+FFFD)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._drop_consumed()
        if delta:
            self._chunks.append(delta)
        return delta

    def _drop_consumed(self) -> None:
        """Forget ids before prefix_offset so memory stays bounded."""
        if self.prefix_offset:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
