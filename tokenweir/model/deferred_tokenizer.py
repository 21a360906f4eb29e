"""A tokenizer from the load cache that is built only when something first needs its text
side: what the engine core process of `tokenweir serve` holds (engine/core_process.py).

That process never tokenizes or detokenizes (the API process does); it reads the EOS ids, and
it may need the vocabulary once a guided-decoding request comes (guided/engine_hooks.py) or
hand the tokenizer's cache form to an API process that found none. Building it
(`Tokenizer.from_cache`: the Rust tokenizer parsed from its JSON, holding the GIL) sat on the
critical path of the core's start; here it happens on first need instead.

Contract: every attribute reads as on `Tokenizer.from_cache(backend_json, fields)` (the same
object is built, once, under a lock, at the first read of anything below the three the cache
fields answer: `eos_token_ids`, `to_cache()`, `built`).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

from tokenweir.model.tokenizer import Tokenizer


class DeferredTokenizer:
    def __init__(self, backend_json: str, fields: Mapping[str, Any]) -> None:
        self._json = backend_json
        self._fields = dict(fields)
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in fields["eos_token_ids"])
        self._tokenizer: Optional[Tokenizer] = None
        self._lock = threading.Lock()

    @property
    def built(self) -> bool:
        """Whether the real tokenizer has been built (a probe for tests and logs)."""
        return self._tokenizer is not None

    def to_cache(self) -> tuple[str, dict[str, Any]]:
        """What `Tokenizer.from_cache` builds this tokenizer from (without building it)."""
        return self._json, dict(self._fields)

    def tokenizer(self) -> Tokenizer:
        """The real tokenizer, built at the first call."""
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = Tokenizer.from_cache(self._json, self._fields)
        return self._tokenizer

    def __getattr__(self, name: str) -> Any:  # anything else: the real tokenizer's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.tokenizer(), name)
