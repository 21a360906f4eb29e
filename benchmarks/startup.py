"""Start-up time of `tokenweir generate` (to its first token) and `tokenweir serve` (to /health
answering 200), cold (the load cache empty) and warm (the cache written by the run before),
each phase timed, each case run `--repeats` times (default 2).

Every run is a fresh interpreter started by this script (`--child` mode), which wraps the
engine's start-up functions as their modules are imported (the command imports them in its own
order: the CLI's preflight and the load cache's prefetch thread run before torch is imported)
and writes one JSON line of phase times:
  import       process start to the end of the engine's imports (torch included); the
               prefetch thread (model/prefetch.py) checks the load cache meanwhile
  model read   resolving the model and reading it: the GGUF parse, or the cache entry mapped
  weights      building the model and copying the weights in (dequantized on a cold run)
  packed       the packed float32 weights mapped from the load cache (packed and written there
               on a cold run; model/packed_cache.py); without it they are packed in `warm-up`
  kernels      loading (or building) the C++ CPU kernels; it happens inside the first forward,
               so it is also part of `warm-up` (or of the first step when the warm-up is off)
  warm-up      the engine's dummy step(s) before serving
  ready        process start to the first token (generate) or to /health 200 (serve)
The kernels are assumed built (the install step builds them); a run that compiles them says
so on stderr. Children run with bytecode caching on (PYTHONDONTWRITEBYTECODE dropped), as a
user's Python does: with it set, every start compiled tokenweir's modules again (~0.7 s of
`import` on a busy 2-core machine).

Usage: python benchmarks/startup.py [--repeats 2] [--model smollm2-135m]
  --warm-only            per command one cold start (printed, to fill the cache), then only warm
  --cache-dir DIR        every start in DIR, kept (for A/B runs on one filled cache): only warm
                         starts (the first one fills DIR if it is empty)
  --commands generate    only these commands (default: generate serve)
  --patch MOD:ATTR=VAL   in the child, set a module attribute (a Python literal) before starting,
                         for A/B runs, e.g. tokenweir.engine.llm_engine:WARM_UP_CPU_TOKENS=64
  --env NAME=VALUE       an environment variable for the child, e.g. TOKENWEIR_PACKED_CACHE=0
  --preimport MODULE     imported by the child before the command starts (counted in `import`),
                         e.g. tokenweir.server.serve: serve's server stack up front, not
                         overlapped with the engine's build
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("import", "model read", "weights", "packed", "kernels", "warm-up", "ready")
PROMPTS = ["What is the capital of France?", "Write a haiku about a river."]


# ---- child: one timed start ---------------------------------------------------------------
def _timed(owner, attribute: str, phase: str, times: dict) -> None:
    """Wrap owner.attribute so that its first call's duration lands in times[phase]."""
    real = getattr(owner, attribute)

    def wrapper(*args, **kwargs):
        started = time.time()
        try:
            return real(*args, **kwargs)
        finally:
            times.setdefault(phase, time.time() - started)

    setattr(owner, attribute, wrapper)


def _instrument_loader(loader, times: dict) -> None:
    _timed(loader, "open_gguf_cached", "model read", times)
    _timed(loader, "_open_hf_dir", "model read", times)
    _timed(loader, "_build", "weights", times)
    _timed(loader, "_attach_packed", "packed", times)


def _on_import(hooks: dict) -> None:
    """Call hooks[name](module) right after the module `name` is first imported (a finder
    ahead of the others that wraps the found loader's exec_module)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in hooks:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                hooks.pop(name)(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _instrument(times: dict, started: float, on_engine) -> None:
    def engine_imported(module):
        times["import"] = time.time() - started
        on_engine(module.LLMEngine)

    _on_import({
        "tokenweir.model.loader": lambda m: _instrument_loader(m, times),
        "tokenweir.model.kernels": lambda m: _timed(m, "_build", "kernels", times),
        "tokenweir.runner.model_runner": lambda m: _timed(m.ModelRunner, "warm_up", "warm-up",
                                                         times),
        "tokenweir.engine.llm_engine": engine_imported})


def _write(times: dict, started: float, out: str) -> None:
    row = {k: v for k, v in times.items()}
    row["ready"] = time.time() - started
    with open(out, "w", encoding="utf-8") as f:
        json.dump(row, f)


def _apply_patches(patches: list[str]) -> None:
    """MOD:ATTR=VALUE, VALUE a Python literal: setattr(import_module(MOD), ATTR, VALUE)."""
    import ast
    import importlib

    for patch in patches:
        target, value = patch.split("=", 1)
        module, attribute = target.split(":")
        setattr(importlib.import_module(module), attribute, ast.literal_eval(value))


def child(command: str, model: str, started: float, out: str, port: int,
          patches: list[str], preimports: list[str]) -> int:
    import importlib

    times: dict = {}

    def on_engine(engine_class) -> None:
        if command != "generate":
            return
        real_step = engine_class.step

        def step(self, *args, **kwargs):
            outputs = real_step(self, *args, **kwargs)
            if "ready" not in times and any(o.outputs and o.outputs[0].token_ids
                                            for o in outputs):
                times["ready"] = True
                _write(times, started, out)
            return outputs

        engine_class.step = step

    _instrument(times, started, on_engine)
    from tokenweir.cli import main

    for module in preimports:
        importlib.import_module(module)
    _apply_patches(patches)
    if command == "generate":
        args = ["generate", "--model", model, "--max-tokens", "4"]
        for prompt in PROMPTS:
            args += ["--prompt", prompt]
        return main(args)
    from tokenweir.server import serve as serve_module

    real_serve = serve_module.serve

    def serve(engine, settings, host, port_, log_level):
        _write(times, started, out + ".engine")  # phases so far; `ready` comes from the parent
        return real_serve(engine, settings, host, port_, log_level)

    serve_module.serve = serve
    return main(["serve", model, "--port", str(port), "--log-level", "warning"])


# ---- parent: runs and the table -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(command: str, model: str, cache_dir: str, patches: list[str],
             extra_env: list[str], preimports: list[str]) -> dict:
    out = tempfile.mktemp(prefix="tokenweir-startup-", suffix=".json")
    port = _free_port()
    env = {**os.environ, "TOKENWEIR_CACHE_DIR": cache_dir, "PYTHONPATH": ROOT,
           "NO_PROXY": "127.0.0.1", **dict(e.split("=", 1) for e in extra_env)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's second start imports cached bytecode
    started = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", command, "--model", model,
           "--started", repr(started), "--out", out, "--port", str(port)]
    for patch in patches:
        cmd += ["--patch", patch]
    for module in preimports:
        cmd += ["--preimport", module]
    if command == "generate":
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as f:
            return json.load(f)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        ready = _wait_health(port, proc)
        row = {**_read_json(out + ".engine"), "ready": ready - started}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return row


def _wait_health(port: int, proc: subprocess.Popen) -> float:
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with status {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1,
                         trust_env=False).status_code == 200:
                return time.time()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--child", choices=("generate", "serve"))
    parser.add_argument("--started", type=float)
    parser.add_argument("--out")
    parser.add_argument("--port", type=int)
    parser.add_argument("--warm-only", action="store_true")
    parser.add_argument("--commands", nargs="+", choices=("generate", "serve"),
                        default=["generate", "serve"])
    parser.add_argument("--patch", action="append", default=[])
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--preimport", action="append", default=[])
    parser.add_argument("--cache-dir")
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args.child, args.model, args.started, args.out, args.port, args.patch,
                       args.preimport))
    print(f"{'command':9} {'start':5} {'run':>3}  " + "  ".join(f"{p:>10}" for p in PHASES))
    for command in args.commands:
        numbers = {"cold": 0, "warm": 0}
        for modes in _schedule(args.repeats, args.warm_only or bool(args.cache_dir)):
            if args.cache_dir:
                modes = modes[1:]  # warm starts only, in the kept directory
            cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tokenweir-startup-cache-")
            try:
                for mode in modes:
                    row = run_once(command, args.model, cache_dir, args.patch, args.env,
                                   args.preimport)
                    cells = "  ".join(f"{row[p]:>9.2f}s" if p in row else f"{'-':>10}"
                                      for p in PHASES)
                    numbers[mode] += 1
                    print(f"{command:9} {mode:5} {numbers[mode]:>3}  {cells}", flush=True)
            finally:
                if not args.cache_dir:
                    shutil.rmtree(cache_dir, ignore_errors=True)


def _schedule(repeats: int, warm_only: bool) -> list[tuple[str, ...]]:
    """The modes run in each fresh cache directory: cold then warm, `repeats` times; with
    warm_only one cold start, then `repeats` warm ones in the same directory."""
    if warm_only:
        return [("cold",) + ("warm",) * repeats]
    return [("cold", "warm")] * repeats


if __name__ == "__main__":
    main()
