"""Checking the load cache's files while torch imports (torch-free: the CLI starts it first).

A warm start checks the words checksum (model/load_cache.py) of the entry's weights file, of
its packed weights (model/packed_cache.py) and of its weights in another dtype
(model/load_cache_cast.py) before using them: two numpy reductions over ~540 MB each (~270 MB
for bfloat16), which release the GIL. `start(path)` runs those checks on a daemon thread while
the main thread imports torch (one core's work on most of a start: the other core is idle);
the readers then take each file's result (load_cache.mapped_words) instead of reading it again.
Only the files the start will read are checked: the weights, then the packed float32 panels
(a float32 CPU model) or the cast copy of the model's dtype (a bfloat16 or float16 CPU model);
`dtype="auto"` is guessed without torch from /proc/cpuinfo as model/loader.py:dtype_choice
decides it (a wrong guess costs only the prefetch of one file: the reader then checks it).

Contract: a result is used only for the file it was computed on, unchanged since:
load_cache.prechecked_words compares the file's (size, mtime_ns, ctime_ns, inode) with the
ones taken before the checksum (any write changes the ctime; a replaced file has a new inode) and otherwise
computes nothing and answers None, so the reader checks the bytes itself as before. A failure
on the thread (no entry, a file gone) leaves no result: the readers then do what they did
without it. TOKENWEIR_PREFETCH=0 turns it off.

Measured (benchmarks/startup.py, warm `generate`, SmolLM2-135M float32, 2-vCPU AVX2, exclusive
lock, off/on interleaved 4 times): ready 4.36 4.08 4.05 3.92 s off, 3.97 3.75 3.21 3.95 s on;
model read 0.32-0.49 -> 0.21-0.27 s, packed 0.15-0.23 -> 0.01 s.
"""

from __future__ import annotations

import glob
import os
import threading
from concurrent.futures import Future
from typing import Optional

from tokenweir.cpu_info import runs_bfloat16_natively
from tokenweir.model import load_cache


def enabled() -> bool:
    return os.environ.get("TOKENWEIR_PREFETCH", "1") != "0"


def start(model_path: str, dtype: str = "auto", device: str = "auto"
          ) -> Optional[threading.Thread]:
    """Check the load cache entry of the GGUF at `model_path` on a daemon thread: the files a
    model of `dtype` on `device` (config.py's ModelConfig values) reads. None: off, not a
    GGUF, or the cache is off."""
    if not (enabled() and model_path.endswith(".gguf") and load_cache.cache_enabled()):
        return None
    derived = derived_files_for(dtype, device)
    thread = threading.Thread(target=_check_entry, args=(model_path, derived), daemon=True,
                              name="tokenweir-prefetch")
    thread.start()
    return thread


def start_for_model(model: str, dtype: str = "auto", device: str = "auto"
                    ) -> Optional[threading.Thread]:
    """`start` for a model argument (alias, .gguf path or HF directory) the preflight passed."""
    from tokenweir.model.paths import resolve_model_path

    return start(resolve_model_path(model), dtype, device)


# The derived files (glob patterns in the entry) each CPU dtype reads besides the weights:
# model/packed_cache.py's panels in float32, model/load_cache_cast.py's copy in its dtype.
_DERIVED = {"float32": "packed-*.safetensors", "bfloat16": "cast-bf16-*.safetensors",
            "float16": "cast-f16-*.safetensors"}


def derived_files_for(dtype: str, device: str) -> tuple[str, ...]:
    """The glob patterns of the derived files a `dtype` model on `device` reads (CUDA: none)."""
    if device == "cuda":
        return ()
    if dtype == "auto":
        dtype = "bfloat16" if runs_bfloat16_natively() else "float32"
    return (_DERIVED[dtype],) if dtype in _DERIVED else ()


def _check_entry(model_path: str, derived: tuple[str, ...]) -> None:
    try:
        root = load_cache.cache_root()
        sha = load_cache.known_digest(model_path, root)
        if sha is None:  # never converted (or changed since): the loader hashes it
            return
        directory = load_cache.entry_dir(root, sha, load_cache.derivation_tag())
        files = [os.path.join(directory, load_cache.WEIGHTS_FILE)]
        for pattern in derived:
            files += sorted(glob.glob(os.path.join(directory, pattern)))
        futures = [load_cache.claim_check(path) for path in files]
        for path, future in zip(files, futures):
            _compute(path, future)
    except Exception:  # noqa: BLE001 (a prefetch never fails a start: the readers check)
        return


def _compute(path: str, future: Future) -> None:
    import numpy as np

    try:
        key = load_cache.stat_key(path)
        future.set_result((key, load_cache.words_checksum(np.memmap(path, mode="r"))))
    except Exception:  # noqa: BLE001 (no result: the reader checks the file itself)
        future.set_result(None)
