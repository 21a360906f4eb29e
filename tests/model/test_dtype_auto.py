"""dtype="auto" (issue 12): bfloat16 only where the machine has native bfloat16 matmuls (AVX-512
BF16 or AMX on a CPU; CUDA with bf16 support), float32 on other CPUs, float16 on an older GPU;
and `tokenweir generate --summary` says which and why."""

from __future__ import annotations

import types

import pytest
import torch

from tokenweir.cli.generate import dtype_line
from tokenweir.model import loader
from tokenweir.model.loader import dtype_choice


def _cpu_features(monkeypatch, bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize("bf16, amx, expected, word", [
    (False, False, torch.float32, "without AVX-512 BF16 or AMX"),
    (True, False, torch.bfloat16, "AVX-512 BF16"),
    (False, True, torch.bfloat16, "AMX"),
])
def test_cpu_choice_follows_the_bf16_instructions(monkeypatch, bf16, amx, expected, word):
    _cpu_features(monkeypatch, bf16, amx)
    dtype, why = dtype_choice("cpu")
    assert dtype == expected and word in why
    assert loader.preferred_dtype("cpu") == expected


def test_plain_avx512_without_bf16_is_float32(monkeypatch):
    """oneDNN says 'bf16 supported' on any AVX-512 core (it emulates); auto must not trust it."""
    _cpu_features(monkeypatch, bf16=False, amx=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    assert dtype_choice("cpu")[0] == torch.float32


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_cuda_choice(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    dtype, why = dtype_choice("cuda")
    assert dtype == expected and "CUDA" in why


def test_this_machine_matches_its_cpu_flags():
    """The real probe on the machine at hand agrees with /proc/cpuinfo (Linux x86)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    native = " avx512_bf16" in flags or " amx_bf16" in flags
    assert dtype_choice("cpu")[0] == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("asked, shown", [("auto", "auto: "), ("float32", "set by --dtype")])
def test_summary_line_says_which_and_why(asked, shown):
    engine = types.SimpleNamespace(
        dtype=dtype_choice("cpu")[0] if asked == "auto" else torch.float32,
        device=torch.device("cpu"),
        config=types.SimpleNamespace(model=types.SimpleNamespace(dtype=asked)))
    line = dtype_line(engine)
    assert shown in line and line.startswith(str(engine.dtype).replace("torch.", ""))
    if asked == "auto":
        assert dtype_choice("cpu")[1] in line
