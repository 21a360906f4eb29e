"""Speed work changes no decision: digests recorded BEFORE the simspeed changes (issue 16) must
come out unchanged. Recorded at commit dd20d94 (main before simspeed), same venv and Python.

The 20,000-request, 64-instance run of `benchmarks/sim_speed.py --cluster --num-requests 20000`
printed digest 919b405e2ada3b745360337c38ecef84f97a96b8b57eca0f1d98f4a2c4366bf8 before the
changes and the same digest after the router's bitmask index (too slow for the suite;
the coordinator may re-run it). Since session 10's partial-prefill counting change (a decision
change) it prints 26aa2b16023531ea48a1323709c0757e85b78335f0855b8b0f81c9840a5fd937. The smaller runs below are kept as tests. That the digest
depends on the decisions at all (is no constant) is test_sim_scale's decision-change test."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from test_sim_scale import _small_cluster_digest

ROOT = Path(__file__).resolve().parents[2]

# 600 requests, 8 instances, cramped pools (400 blocks): preempts (29 preemptions recorded).
# Re-recorded for one intended change (session 10): the partial-prefill cap no longer counts
# a request whose prefill finishes in the step (was d9ea3908..., 30 preemptions).
SMALL_CRAMPED = "2648e11c878f5205c69c22a7f70742a5d8f6b493a69b5b6052fc697385098f46"
# benchmarks/sim_speed.py --cluster --num-requests 2000 --num-instances 16
BENCH_2000_16 = "406c475ded8f37e6229277418fb2209484ad2721279c3e9dead4834a77bb6c51"


def test_the_cramped_small_cluster_decides_as_before_the_speed_work():
    digest, preemptions = _small_cluster_digest()
    assert preemptions == 29  # the probe: the preemption paths really ran, as recorded
    assert digest == SMALL_CRAMPED


@pytest.fixture(scope="module")
def bench_2000_16():
    """`benchmarks/sim_speed.py --cluster --num-requests 2000 --num-instances 16` plus the
    flags asked, in a process of its own: its stdout's lines. Each flag set runs once per
    module (the default run serves both tests below: the same command)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_speed.py"), "--cluster",
           "--num-requests", "2000", "--num-instances", "16"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    runs: dict[tuple, list[str]] = {}

    def run(*extra: str) -> list[str]:
        if extra not in runs:
            runs[extra] = subprocess.run(cmd + list(extra), capture_output=True, text=True,
                                         check=True, cwd=ROOT, env=env).stdout.splitlines()
        return runs[extra]

    return run


def test_the_cluster_benchmark_decides_as_before_the_speed_work(bench_2000_16):
    out = bench_2000_16()
    assert "requests 2000/2000" in "\n".join(out)
    assert f"digest {BENCH_2000_16}" in out


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def _glibc_has_hugetlb() -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)


@pytest.mark.skipif(not _glibc_has_hugetlb(), reason="glibc.malloc.hugetlb needs glibc >= 2.35")
def test_huge_pages_change_where_objects_live_not_what_is_decided(bench_2000_16):
    """Huge pages (the default for --cluster where offered; `--no-huge-pages` off,
    `--huge-pages` on) re-execute the benchmark with its objects in glibc malloc on transparent
    huge pages: the same digest every way; probes: the run's memory is in huge pages (where
    the kernel offers them), the default run's too, and the `--no-huge-pages` run's is not."""
    flags = (["--no-huge-pages"], ["--huge-pages"], [])
    outs = [bench_2000_16(*extra) for extra in flags]
    offered = _thp_mode() in ("madvise", "always")
    huge = "glibc malloc on transparent huge pages"
    huge_kib = []
    for out, where in zip(outs, ("pymalloc", huge, huge if offered else "pymalloc")):
        assert f"digest {BENCH_2000_16}" in out
        [line] = [x for x in out if x.startswith("objects: ")]
        assert line.startswith(f"objects: {where}")
        huge_kib.append(int(line.split("AnonHugePages ")[1].split()[0]))
    if offered:
        assert huge_kib[1] > 10_000 and huge_kib[2] > 10_000  # tens of MB in huge pages
    if _thp_mode() == "madvise":
        assert huge_kib[0] == 0
