"""Bad settings are refused before the model loads, in one line naming the flag and the fix
(exit status 2 on the command line, ValueError offline); max_tokens beyond the context is
refused (not clamped) with both numbers named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenweir.config import EngineConfig
from tokenweir.engine.preflight import ConfigError, check_before_load, flag_spelling
from tokenweir.model.gguf_header import context_length, read_scalars
from tokenweir.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "model"))
from tiny_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_gguf_header_matches_gguf_py(gguf_path):
    from gguf import GGUFReader

    from tokenweir.model.loader import read_gguf_metadata

    meta = read_gguf_metadata(GGUFReader(gguf_path))
    keys = ["general.architecture", "llama.context_length", "llama.block_count",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model"]
    assert read_scalars(gguf_path, keys) == {k: meta[k] for k in keys}
    assert context_length(gguf_path) == meta["llama.context_length"] == 256


def refused(**kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        check_before_load(EngineConfig.from_kwargs(**kwargs))
    return exc.value


def test_pool_too_small_counts_the_null_block(gguf_path):
    # 256 tokens / 16 = 16 blocks + the null block = 17: 16 is one short
    error = refused(model=gguf_path, num_gpu_blocks_override=16)
    assert error.field == "num_gpu_blocks_override"
    assert str(error).startswith("num_gpu_blocks_override=16 is too small")
    line = error.render(flag_spelling)
    assert "--num-gpu-blocks-override 17 or more" in line and "--max-model-len 240 or less" in line
    assert check_before_load(EngineConfig.from_kwargs(model=gguf_path,
                                                      num_gpu_blocks_override=17)) == 256
    assert check_before_load(EngineConfig.from_kwargs(
        model=gguf_path, num_gpu_blocks_override=16, max_model_len=240)) == 240


def test_other_refusals_name_their_field(gguf_path, tmp_path):
    assert refused(model=str(tmp_path / "missing.gguf")).field == "model"
    assert refused(model=gguf_path, max_model_len=257).field == "max_model_len"
    budget = refused(model=gguf_path, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert budget.field == "max_num_batched_tokens"


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`tokenweir ...` in a child whose loader fails loudly if reached, reporting whether torch
    was imported at all."""
    code = ("import sys, tokenweir.model\n"
            "from tokenweir.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH')\n"
            "sys.exit(rc)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("args, flag", [
    (["--num-gpu-blocks-override", "16"], "--num-gpu-blocks-override 16 is too small"),
    (["--temperature", "-1"], "--temperature: temperature must be >= 0"),
    (["--max-model-len", "9999"], "--max-model-len 9999 exceeds the model's context length 256"),
    (["--model", "/no/such/model.gguf"], "give --model PATH"),
    (["--quantization", "int4"], "argument --quantization: invalid choice: 'int4'"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_in_one_line_before_loading(gguf_path, args, flag, command):
    if command == "serve" and args[0] == "--temperature":
        pytest.skip("serve takes no --temperature")
    result = run_cli(command, "--model", gguf_path, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], result.stderr
    assert lines[0].startswith(f"tokenweir {command}: error:")
    if "invalid choice" not in flag:  # argparse's own exit comes before the probe line
        assert "NO_TORCH" in result.stdout  # probe: refused before torch, let alone the model


def test_offline_max_tokens_beyond_the_context_is_refused(make_llm):
    llm = make_llm(max_model_len=128, num_gpu_blocks_override=64)
    prompt = list(range(100, 200))  # 100 tokens: 28 left
    with pytest.raises(ValueError, match=r"max_tokens=500 .* 100 tokens and max_model_len is "
                                         r"128, which leaves room for 28"):
        llm.generate([prompt], SamplingParams(max_tokens=500), use_tqdm=False)
    # probe: the edge itself is accepted, and honoured; unset: all the room left (one batch:
    # 28 decode steps for both, not 56)
    edge, left = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (28, None))
    fits, unset = llm.generate([prompt, prompt], [edge, left], use_tqdm=False)
    assert len(fits.outputs[0].token_ids) == 28
    assert len(unset.outputs[0].token_ids) == 28
