"""tokenweir/cpu_info.py: /proc/cpuinfo read without torch, on a written file and a missing one."""
import pytest

from tokenweir import cpu_info

FAKE = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Example CPU @ 2.0GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile
flags extra\t: not the flags line

processor\t: 1
model name\t: Second CPU
flags\t\t: fpu
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Point cpu_info at a file the test writes (its cache cleared before and after)."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_info, "CPUINFO", str(path))
    cpu_info.cpu_flags.cache_clear()
    yield path
    cpu_info.cpu_flags.cache_clear()


def test_the_first_cpus_flags_and_model(cpuinfo):
    cpuinfo.write_text(FAKE)
    assert cpu_info.cpu_flags() == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_info.kernel_flags() == ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    assert cpu_info.cpu_model() == "Example CPU @ 2.0GHz"
    assert cpu_info.runs_bfloat16_natively()


@pytest.mark.parametrize("flags,native", [("avx2 fma", False), ("avx512f avx512bw", False),
                                          ("avx2 amx_tile", True), ("avx512_bf16", True)])
def test_bfloat16_is_native_with_amx_or_avx512_bf16_only(cpuinfo, flags, native):
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_info.runs_bfloat16_natively() is native


def test_a_missing_file_means_no_flags(cpuinfo):
    assert not cpuinfo.exists()
    assert cpu_info.cpu_flags() == frozenset()
    assert not cpu_info.runs_bfloat16_natively()
    assert cpu_info.cpu_model()  # platform's answer, or "unknown"
