"""The load cache: what loading a GGUF file derives, written once and memory-mapped after.

Loading a GGUF pays for parsing its metadata (SmolLM2: 98k tokenizer strings, 2-8 s in
`gguf.GGUFReader`), dequantizing every tensor with numpy (2-12 s) and building the tokenizer.
None of it depends on anything but the file and the code that derives it, so the first load
writes an entry and later loads read it:

    <root>/gguf/<source sha256[:20]>-<derivation[:12]>/
        manifest.json          what the entry holds, for which source, by which code, checksums
        weights.safetensors    every tensor as the loader yields it (HF name, float32, Q/K
                               already un-permuted), in the order the GGUF lists them, except
                               each layer's q/k/v and gate/up stored fused under the model's
                               name (llama.py, fuse_checkpoint), so that a float32 load adopts
                               them without a copy
        tokenizer.json         the Rust tokenizer (`tokenizers.Tokenizer.to_str()`)

Contracts:
* **Keyed by content and by code.** The source key is the SHA-256 of the whole GGUF file (not
  its name or size): a different file never hits another's entry. Hashing 98 MB on every start
  would cost ~0.2-0.5 s, so the digest is remembered in `<root>/sources.json` against the file's
  (size, mtime_ns, ctime_ns, inode): any write to the file changes its ctime (which user space
  cannot set back), and a replaced file has a new inode, so a stale digest is never trusted.
  The derivation tag hashes CACHE_FORMAT, the source text of every module that shapes an
  entry's content (this one, loader.py, tokenizer.py, arch.py, llama.py) and the versions of gguf,
  tokenizers and numpy: an entry written by other code is a different directory, never read.
* **Checked on every read.** A manifest that does not parse or names another source or
  derivation, a payload file whose size differs from the manifest (truncated), or whose checksum
  differs (corrupt) is reported on stderr, deleted and rebuilt from the GGUF. The weights'
  checksum is the wrapping 64-bit sum and the xor of the file's 8-byte words (two numpy
  reductions): it catches any flipped bit, any truncation or zeroed page (not a deliberate
  forgery, which is not what it guards against). Measured on a heavily shared 2-core machine:
  0.42 s for SmolLM2's 540 MB, as crc32 took there (0.43 s); sha256 0.98 s.
* **Written atomically.** An entry is built in a temporary sibling directory and renamed into
  place; a reader never sees half an entry. Entries of the same source by other code are
  removed when a new one is written (each holds a float32 copy of the weights).
* **Off switch.** TOKENWEIR_LOAD_CACHE=0 disables reading and writing; TOKENWEIR_CACHE_DIR moves
  the root (default $XDG_CACHE_HOME/tokenweir, else ~/.cache/tokenweir).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import numpy as np

from tokenweir.model.arch import ArchConfig

if TYPE_CHECKING:  # torch is imported where a tensor is made: model/prefetch.py imports this
    import torch  # module on a thread while the main thread imports torch

# realpath -> Future of (stat key, words checksum) or None: files model/prefetch.py checks
_PRECHECKED: dict[str, Future] = {}
_PRECHECKED_LOCK = threading.Lock()

CACHE_FORMAT = 2  # bump when an entry's layout or meaning changes
WEIGHTS_FILE, _TOKENIZER, _MANIFEST = "weights.safetensors", "tokenizer.json", "manifest.json"
_DERIVING_MODULES = ("load_cache.py", "loader.py", "tokenizer.py", "arch.py", "llama.py")
_DERIVING_PACKAGES = ("gguf", "tokenizers", "numpy")
_DATA_ALIGN = 64  # the tensor data starts at a multiple of this (float32 views need 4)
# safetensors dtype name -> (torch dtype name, bytes per element): what a weights file may hold
# (the entry's own file: F32; model/load_cache_cast.py's: BF16 or F16)
SAFETENSORS_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}


class CacheCorrupt(Exception):
    """An entry exists but cannot be trusted (the message says why)."""


def notice(message: str) -> None:
    """One line on stderr: what the cache does that the user pays for or should know."""
    print(f"tokenweir: {message}", file=sys.stderr, flush=True)


def cache_enabled() -> bool:
    return os.environ.get("TOKENWEIR_LOAD_CACHE", "1") != "0"


def cache_root() -> str:
    """The cache's root directory (not created here)."""
    explicit = os.environ.get("TOKENWEIR_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenweir")


# ---- keys ---------------------------------------------------------------------------------
def derivation_tag() -> str:
    """Hex digest of everything besides the source file that shapes an entry's content."""
    digest = hashlib.sha256(f"format {CACHE_FORMAT}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _DERIVING_MODULES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    for package in _DERIVING_PACKAGES:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{package}=={version}".encode())
    return digest.hexdigest()


def stat_key(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_digest(path: str, root: str) -> str:
    """SHA-256 of the file at `path`, remembered in <root>/sources.json against its stat key
    (see the module contract) so a warm start hashes nothing."""
    known = known_digest(path, root)
    if known is not None:
        return known
    path = os.path.realpath(path)
    key = stat_key(path)
    sha = file_sha256(path)
    if stat_key(path) == key:  # unchanged while we read it: safe to remember
        index_path = os.path.join(root, "sources.json")
        index = _read_json_or_empty(index_path)
        index[path] = {"stat": key, "sha256": sha}
        write_json_atomic(index_path, index)
    return sha


def known_digest(path: str, root: str) -> Optional[str]:
    """The digest remembered for the file at `path` as it is now, or None (hashes nothing)."""
    path = os.path.realpath(path)
    known = _read_json_or_empty(os.path.join(root, "sources.json")).get(path)
    if isinstance(known, dict) and known.get("stat") == stat_key(path) and \
            isinstance(known.get("sha256"), str):
        return known["sha256"]
    return None


def entry_dir(root: str, source_sha: str, derivation: str) -> str:
    return os.path.join(root, "gguf", f"{source_sha[:20]}-{derivation[:12]}")


# ---- what an entry holds --------------------------------------------------------------------
@dataclass
class CachedLoad:
    """An entry read back: the architecture, the weights as (HF name, float32 tensor) pairs
    whose tensors view a private (copy-on-write) mapping of the file, and the tokenizer's
    parts (None when the GGUF has no vocabulary)."""

    arch: ArchConfig
    weights: list[tuple[str, torch.Tensor]]
    tokenizer_json: Optional[str]
    tokenizer_fields: Optional[dict[str, Any]]


def arch_to_json(arch: ArchConfig) -> dict[str, Any]:
    return asdict(arch)


def arch_from_json(data: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**{**data, "eos_token_ids": tuple(data.get("eos_token_ids") or ())})


# ---- safetensors, streamed -----------------------------------------------------------------
def _safetensors_header(specs: list[tuple[str, tuple[int, ...]]], dtype: str = "F32") -> bytes:
    """The header of a safetensors file holding `specs` (name, shape) in order, every tensor of
    `dtype` (a SAFETENSORS_DTYPES name), padded with spaces so that the data starts at a
    multiple of _DATA_ALIGN."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "tokenweir"}}
    offset, width = 0, SAFETENSORS_DTYPES[dtype][1]
    for name, shape in specs:
        size = width * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % _DATA_ALIGN)
    return len(text).to_bytes(8, "little") + text


def write_weights(path: str, specs: list[tuple[str, tuple[int, ...]]],
                  tensors: Iterable[tuple[str, torch.Tensor]], dtype: str = "F32") -> None:
    """Stream `tensors` (of `dtype`, a SAFETENSORS_DTYPES name; contiguous; names and shapes
    exactly `specs`, in order) into a safetensors file: one tensor in memory at a time."""
    import torch

    with open(path, "wb") as f:
        f.write(_safetensors_header(specs, dtype))
        for (name, shape), (got, tensor) in zip(specs, tensors, strict=True):
            if got != name or tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != \
                    f"torch.{SAFETENSORS_DTYPES[dtype][0]}":
                raise ValueError(f"load cache: tensor {got!r} {tuple(tensor.shape)} "
                                 f"{tensor.dtype} does not match the header's {name!r} {shape}")
            raw = tensor.contiguous().reshape(-1).view(torch.uint8)  # numpy has no bfloat16
            f.write(memoryview(raw.numpy()).cast("B"))


def _map_file(path: str) -> torch.Tensor:
    """The whole file as a uint8 tensor over a MAP_PRIVATE mapping (writes stay private)."""
    import torch

    return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)


def read_weights(buffer: torch.Tensor, dtype: str = "F32") -> list[tuple[str, torch.Tensor]]:
    """(name, view) for every tensor of a mapped safetensors file written by write_weights
    with `dtype`; CacheCorrupt when the header does not describe the buffer exactly (a tensor
    of another dtype included)."""
    import torch

    raw = buffer.numpy()
    if raw.size < 8:
        raise CacheCorrupt("weights file shorter than its header length")
    header_len = int.from_bytes(raw[:8].tobytes(), "little")
    start = 8 + header_len
    if start > raw.size:
        raise CacheCorrupt("weights header runs past the end of the file")
    try:
        header = json.loads(raw[8:start].tobytes())
    except ValueError as exc:
        raise CacheCorrupt(f"weights header is not JSON ({exc})") from None
    header.pop("__metadata__", None)
    out, end = [], 0
    for name, spec in header.items():
        first, last = spec["data_offsets"]
        if spec.get("dtype") != dtype or first != end or (start + first) % 4:
            raise CacheCorrupt(f"weights header entry {name!r} is not what this cache writes")
        end = last
        view = buffer[start + first:start + last].view(getattr(torch, SAFETENSORS_DTYPES[dtype][0]))
        out.append((name, view.view(tuple(spec["shape"]))))
    if start + end != raw.size:
        raise CacheCorrupt(f"weights file holds {raw.size} bytes, its header describes "
                           f"{start + end}")
    return out


def words_checksum(raw: np.ndarray) -> list[int]:
    """[wrapping 64-bit sum, xor] of a byte array's 8-byte words (its tail zero-padded)."""
    whole = raw.size - raw.size % 8
    words = raw[:whole].view(np.uint64)
    tail = np.zeros(8, dtype=np.uint8)
    tail[:raw.size - whole] = raw[whole:]
    tail_word = tail.view(np.uint64)[0]
    total = (int(np.add.reduce(words, dtype=np.uint64)) + int(tail_word)) % 2**64
    xor = int(np.bitwise_xor.reduce(words)) if words.size else 0
    return [total, xor ^ int(tail_word)]


def mapped_words(path: str, buffer: "torch.Tensor") -> list[int]:
    """words_checksum of the file at `path`, mapped as `buffer`: model/prefetch.py's result
    when its thread checked this file unchanged, else computed over `buffer` now."""
    words = prechecked_words(path)
    return words if words is not None else words_checksum(buffer.numpy())


def claim_check(path: str) -> Future:
    """A slot for the words checksum of `path`, to be set to (stat key taken before the
    checksum, words) or None by the checker (model/prefetch.py)."""
    future: Future = Future()
    with _PRECHECKED_LOCK:
        _PRECHECKED[os.path.realpath(path)] = future
    return future


def prechecked_words(path: str) -> Optional[list[int]]:
    """The checksum a prefetch computed for `path` (waiting for it if under way), used once;
    None when there is none for the file as it is now (same stat key: any write changes the
    ctime, a replaced file has a new inode)."""
    with _PRECHECKED_LOCK:
        future = _PRECHECKED.pop(os.path.realpath(path), None)
    result = None if future is None else future.result()
    if result is None:
        return None
    key, words = result
    try:
        return words if stat_key(path) == key else None
    except OSError:
        return None


# ---- reading ----------------------------------------------------------------------------------
def read_entry(directory: str, source_sha: str, derivation: str) -> Optional[CachedLoad]:
    """The entry at `directory`, None when there is none; CacheCorrupt when one is there but
    fails a check (see the module contract)."""
    manifest_path = os.path.join(directory, _MANIFEST)
    if not os.path.isdir(directory):
        return None
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CacheCorrupt(f"manifest unreadable ({exc.__class__.__name__})") from None
    expected = {"format": CACHE_FORMAT, "source_sha256": source_sha, "derivation": derivation}
    for key, value in expected.items():
        if not isinstance(manifest, dict) or manifest.get(key) != value:
            raise CacheCorrupt(f"manifest {key} does not match")
    files = manifest["files"]
    _check_size(directory, WEIGHTS_FILE, files[WEIGHTS_FILE]["size"])
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    buffer = _map_file(weights_path)
    if mapped_words(weights_path, buffer) != files[WEIGHTS_FILE]["words"]:
        raise CacheCorrupt(f"{WEIGHTS_FILE} checksum mismatch")
    weights = read_weights(buffer)
    tokenizer_json = None
    if manifest.get("tokenizer") is not None:
        tokenizer_json = _read_tokenizer(directory, files[_TOKENIZER])
    return CachedLoad(arch=arch_from_json(manifest["arch"]), weights=weights,
                      tokenizer_json=tokenizer_json, tokenizer_fields=manifest.get("tokenizer"))


def read_tokenizer(directory: str, source_sha: str,
                   derivation: str) -> Optional[tuple[str, dict[str, Any]]]:
    """The tokenizer of the entry at `directory` as `Tokenizer.from_cache` takes it, checked
    like `read_entry` checks it (manifest keys, size, checksum), without the weights: what the
    API process of `tokenweir serve --engine-process` reads (no torch). None when the entry or
    its tokenizer is missing; CacheCorrupt when a check fails."""
    try:
        with open(os.path.join(directory, _MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CacheCorrupt(f"manifest unreadable ({exc.__class__.__name__})") from None
    expected = {"format": CACHE_FORMAT, "source_sha256": source_sha, "derivation": derivation}
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in expected.items()):
        raise CacheCorrupt("manifest does not match")
    if manifest.get("tokenizer") is None:
        return None
    return _read_tokenizer(directory, manifest["files"][_TOKENIZER]), manifest["tokenizer"]


def _check_size(directory: str, name: str, size: int) -> None:
    try:
        actual = os.path.getsize(os.path.join(directory, name))
    except OSError:
        raise CacheCorrupt(f"{name} is missing") from None
    if actual != size:
        raise CacheCorrupt(f"{name} holds {actual} bytes, the manifest says {size} (truncated?)")


def _read_tokenizer(directory: str, spec: dict[str, Any]) -> str:
    _check_size(directory, _TOKENIZER, spec["size"])
    with open(os.path.join(directory, _TOKENIZER), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != spec["sha256"]:
        raise CacheCorrupt(f"{_TOKENIZER} checksum mismatch")
    return data.decode("utf-8")


# ---- writing ----------------------------------------------------------------------------------
def write_entry(directory: str, source: str, source_sha: str, derivation: str, arch: ArchConfig,
                specs: list[tuple[str, tuple[int, ...]]],
                tensors: Iterable[tuple[str, torch.Tensor]],
                tokenizer_json: Optional[str], tokenizer_fields: Optional[dict[str, Any]]) -> None:
    """Write an entry atomically (temporary sibling, then rename); if another process renamed
    its own first, ours is discarded. Older entries of the same source are removed."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = f"{directory}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(staging)
    try:
        files = _write_payload(staging, specs, tensors, tokenizer_json)
        manifest = {"format": CACHE_FORMAT, "source_sha256": source_sha,
                    "derivation": derivation, "source_path": source,
                    "arch": arch_to_json(arch), "tokenizer": tokenizer_fields, "files": files}
        write_json_atomic(os.path.join(staging, _MANIFEST), manifest)
        _replace_dir(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_siblings(directory, source_sha)


def _write_payload(staging: str, specs, tensors, tokenizer_json: Optional[str]) -> dict:
    weights_path = os.path.join(staging, WEIGHTS_FILE)
    write_weights(weights_path, specs, tensors)
    words = words_checksum(np.fromfile(weights_path, dtype=np.uint8))
    files: dict[str, Any] = {WEIGHTS_FILE: {"size": os.path.getsize(weights_path),
                                            "words": words}}
    if tokenizer_json is not None:
        data = tokenizer_json.encode("utf-8")
        with open(os.path.join(staging, _TOKENIZER), "wb") as f:
            f.write(data)
        files[_TOKENIZER] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return files


def _replace_dir(staging: str, directory: str) -> None:
    try:
        os.rename(staging, directory)
    except OSError:  # another process wrote the same entry first: keep theirs
        if not os.path.isdir(directory):
            raise


def remove_entry(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _remove_siblings(directory: str, source_sha: str) -> None:
    """Delete entries of the same source written by other code (never read again)."""
    parent, own = os.path.dirname(directory), os.path.basename(directory)
    for name in os.listdir(parent):
        if name != own and name.startswith(source_sha[:20] + "-") and ".tmp-" not in name:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# ---- small files --------------------------------------------------------------------------
def _read_json_or_empty(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_checked_file(stem: str, write: Callable[[str], None], meta: dict[str, Any]) -> None:
    """<stem>.safetensors, written by `write(path)` to a staging path, then its side file
    <stem>.json: `meta` plus the file's "size" and "words" (words_checksum); each renamed into
    place, the side file last, so a reader that finds the side file finds the whole file (the
    load cache's derived files: packed_cache.py, load_cache_cast.py)."""
    staging = f"{stem}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(staging)
        words = words_checksum(np.fromfile(staging, dtype=np.uint8))
        side = {**meta, "size": os.path.getsize(staging), "words": words}
        os.replace(staging, f"{stem}.safetensors")
        write_json_atomic(f"{stem}.json", side)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def read_checked_file(stem: str) -> Optional[tuple[dict[str, Any], "torch.Tensor"]]:
    """(the side file's dict, <stem>.safetensors mapped copy-on-write as uint8) of a file that
    write_checked_file finished; None when there is no side file; CacheCorrupt when the side
    file is unreadable or the file's size or words differ from it."""
    if not os.path.exists(f"{stem}.json"):
        return None
    try:
        with open(f"{stem}.json", encoding="utf-8") as f:
            meta = json.load(f)
        size, words = int(meta["size"]), [int(w) for w in meta["words"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CacheCorrupt(f"side file unreadable ({exc.__class__.__name__})") from None
    path = f"{stem}.safetensors"
    actual = os.path.getsize(path) if os.path.exists(path) else -1
    if actual != size:
        raise CacheCorrupt(f"the file holds {actual} bytes, its side file says {size} "
                           "(truncated?)")
    buffer = _map_file(path)  # the size was just checked
    if mapped_words(path, buffer) != words:
        raise CacheCorrupt("checksum mismatch")
    return meta, buffer


def remove_checked_file(stem: str) -> None:
    """Remove what write_checked_file wrote: the side file first (no reader trusts the rest)."""
    for suffix in (".json", ".safetensors"):
        try:
            os.remove(stem + suffix)
        except FileNotFoundError:
            pass


def write_json_atomic(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(staging, path)


# ---- the loader's entry point -----------------------------------------------------------
@dataclass
class GGUFSource:
    """A GGUF parsed but not yet dequantized: the architecture, the tensors' (HF name, shape)
    in file order, a function returning a fresh iterator over them (name, float32 tensor), and
    the tokenizer (a model/tokenizer.py Tokenizer, or None)."""

    arch: ArchConfig
    specs: list[tuple[str, tuple[int, ...]]]
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Any
