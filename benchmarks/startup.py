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

What makes one warm start slower than the next (start10, 2-vCPU AMD EPYC, exclusive lock):
- torch's import alone (`import torch`, nothing else running) took 2.07-2.70 CPU-s for the
  same work (39,965 page faults each time, no major fault, no steal): the VM's CPU speed moves
  by ~25% from run to run; nothing tokenweir imports or calls pulls in sympy or torch._dynamo,
  and loading torch.export / torch._meta_registrations lazily saved nothing measurable.
- the page cache: this machine's DAMON scheme pages out file pages unmapped and unused for
  ~60 s. Serve after evicting the load cache's entry: 3.26 3.09 3.04 s (warm 2.89 2.86 2.72);
  after evicting torch's .so and .pyc files: 4.02 3.61 3.36 s. Asking the kernel to read
  torch's libraries ahead (POSIX_FADV_WILLNEED at the CLI's start) did not help (serve after
  eviction 3.59 s mean with it, 3.46 without; 4 interleaved pairs).

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
  --dtype DTYPE          the command's --dtype (default: none given, i.e. auto); the last
                         column prints the dtype each start's model was built in
  --serve-flag FLAG      serve: one more flag for `tokenweir serve` (repeatable), e.g.
                         --serve-flag=--no-engine-process for the in-process engine
  --first-request N      serve: once /health answers 200, time one completion of a ~N-token
                         prompt (max_tokens 1) sent at once: column "first req", the seconds
                         from sending it to its answer (what a warm-up moves before `ready`)
  --timeline             after each row, the start's events: when each watched module's import
                         (TIMELINE_MODULES) and each watched call (TIMELINE_CALLS) began and
                         ended, on which thread, in seconds from process start (a diagnosis
                         aid: the wrappers cost a little, so a row with it is not a figure)
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
import threading
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("import", "model read", "weights", "packed", "kernels", "warm-up", "ready",
          "first req")
PROMPTS = ["What is the capital of France?", "Write a haiku about a river."]
# --timeline: imports whose span is recorded (the first import of each, nested ones included)
TIMELINE_MODULES = ("numpy", "torch", "jinja2", "llguidance", "tokenizers", "fastapi",
                    "pydantic", "uvicorn", "starlette", "prometheus_client",
                    "tokenweir.model.load_cache", "tokenweir.engine.llm_engine",
                    "tokenweir.server.serve", "tokenweir.server.app")
# --timeline: "module:Owner.attribute" calls whose first span is recorded
TIMELINE_CALLS = (
    "tokenweir.cli.parser:build_parser", "tokenweir.engine.llm_engine:LLMEngine.__init__",
    "tokenweir.model.loader:load_model", "tokenweir.model.tokenizer:Tokenizer.from_cache",
    "tokenweir.model.tokenizer:_compile_template",
    "tokenweir.runner.model_runner:ModelRunner.warm_up",
    "tokenweir.engine.llm_engine:LLMEngine.step", "tokenweir.server.app:create_app",
    "uvicorn.server:Server.startup", "uvicorn.server:Server.serve",
    "tokenweir.engine.core_client:cached_tokenizer",
    "tokenweir.engine.core_client:CoreClient.wait_ready",
    "tokenweir.engine.core_client:RemoteEngine.connect",
    "tokenweir.engine.async_engine:AsyncEngine.__init__",
    "tokenweir.engine.core_process:_build", "tokenweir.engine.core_process:ready_info")


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
    _record_dtype(loader, times)
    _timed(loader, "open_gguf_cached", "model read", times)
    _timed(loader, "_open_hf_dir", "model read", times)
    _timed(loader, "_build", "weights", times)
    _timed(loader, "_attach_packed", "packed", times)


def _record_dtype(loader, times: dict) -> None:
    """times["dtype"]: the dtype the model was built in (load_model's argument as the
    command resolved it: `auto` has become bfloat16 or float32 by then)."""
    real = loader.load_model

    def load_model(*args, **kwargs):
        loaded = real(*args, **kwargs)
        times.setdefault("dtype", str(loaded.model.lm_head_weight.dtype).replace("torch.", ""))
        return loaded

    loader.load_model = load_model


def _on_import(hooks: dict, spans: tuple = ()) -> None:
    """Call hooks[name](module) right after the module `name` is first imported (a finder
    ahead of the others that wraps the found loader's exec_module). spans: (events, started):
    also append (start, end, thread, "import NAME") to events for each TIMELINE_MODULES
    import, from its execution's start to its end (the imports it makes included)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            timed = bool(spans) and name in TIMELINE_MODULES
            if name not in hooks and not timed:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                begun = time.time()
                execute(module)
                if timed:
                    spans[0].append(_event(begun, spans[1], f"import {name}"))
                if name in hooks:
                    hooks.pop(name)(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _event(begun: float, started: float, label: str) -> tuple:
    """(start, end, thread, label): seconds from process start, ended now."""
    return (begun - started, time.time() - started, threading.current_thread().name, label)


def _call_span(owner, attribute: str, label: str, events: list, started: float) -> None:
    """Wrap owner.attribute so that its first call's span lands in events."""
    raw = owner.__dict__.get(attribute)
    real = getattr(owner, attribute)  # bound already where raw is a class/static method

    def wrapper(*args, **kwargs):
        begun = time.time()
        try:
            return real(*args, **kwargs)
        finally:
            if not any(e[3] == label for e in events):
                events.append(_event(begun, started, label))

    async def async_wrapper(*args, **kwargs):
        begun = time.time()
        try:
            return await real(*args, **kwargs)
        finally:
            if not any(e[3] == label for e in events):
                events.append(_event(begun, started, label))

    import inspect

    chosen = async_wrapper if inspect.iscoroutinefunction(real) else wrapper
    bound = isinstance(raw, (classmethod, staticmethod))
    setattr(owner, attribute, staticmethod(chosen) if bound else chosen)


def _timeline_hooks(events: list, started: float) -> dict:
    """module name -> hook installing _call_span on that module's TIMELINE_CALLS."""
    by_module: dict = {}
    for path in TIMELINE_CALLS:
        module, _, dotted = path.partition(":")
        by_module.setdefault(module, []).append(dotted)

    def installer(dotted_names: list):
        def install(module):
            for dotted in dotted_names:
                owner_name, _, attribute = dotted.rpartition(".")
                owner = getattr(module, owner_name) if owner_name else module
                _call_span(owner, attribute, dotted + "()", events, started)
        return install

    return {module: installer(names) for module, names in by_module.items()}


def _merge_hooks(*tables: dict) -> dict:
    merged: dict = {}
    for table in tables:
        for name, hook in table.items():
            before = merged.get(name)
            merged[name] = hook if before is None else (
                lambda m, a=before, b=hook: (a(m), b(m)))
    return merged


def _instrument(times: dict, started: float, on_engine, events: Optional[list],
                more_hooks: dict) -> None:
    def engine_imported(module):
        times["import"] = time.time() - started
        on_engine(module.LLMEngine)

    hooks = {
        "tokenweir.model.loader": lambda m: _instrument_loader(m, times),
        "tokenweir.model.kernels": lambda m: _timed(m, "_build", "kernels", times),
        "tokenweir.runner.model_runner": lambda m: _timed(m.ModelRunner, "warm_up", "warm-up",
                                                         times),
        "tokenweir.engine.llm_engine": engine_imported, **more_hooks}
    if events is None:
        _on_import(hooks)
        return
    _on_import(_merge_hooks(hooks, _timeline_hooks(events, started)), (events, started))


def _write(times: dict, started: float, out: str) -> None:
    row = {k: v for k, v in times.items()}
    row["ready"] = time.time() - started
    _dump(row, out)


def _dump(data, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _core_events(module, events: list, started: float, out: str) -> None:
    """--timeline, serve with the engine core in its own process: the forked core names its
    main thread "core" and, when its loop begins (right after it said "ready"), writes the
    events it recorded since the fork to OUT.core (its atexit never runs: a multiprocessing
    child leaves by os._exit)."""
    real_main, real_run = module.core_main, module.CoreLoop.run

    def core_main(*args, **kwargs):
        threading.current_thread().name = "core"
        first = len(events)
        module.CoreLoop.run = lambda loop: (
            events.append(_event(time.time(), started, "core loop begins (ready sent)")),
            _dump(sorted(events[first:]), out + ".core"), real_run(loop))[-1]
        return real_main(*args, **kwargs)

    module.core_main = core_main


def _core_phases(module, times: dict, out: str) -> None:
    """Serve with the engine core in its own process (forked after this hook ran, so the
    loader, kernel and warm-up wrappers are in it too and fill the core's copy of `times`):
    the core writes its phases to OUT.core-phases when it tells the API process "ready"
    (ready_info runs right before that message), so the file is there before /health answers
    200. The parent's row takes the core's phases over the API process's own."""
    real = module.ready_info

    def ready_info(engine):
        _dump(times, out + ".core-phases")
        return real(engine)

    module.ready_info = ready_info


def _apply_patches(patches: list[str]) -> None:
    """MOD:ATTR=VALUE, VALUE a Python literal: setattr(import_module(MOD), ATTR, VALUE)."""
    import ast
    import importlib

    for patch in patches:
        target, value = patch.split("=", 1)
        module, attribute = target.split(":")
        setattr(importlib.import_module(module), attribute, ast.literal_eval(value))


def child(command: str, model: str, started: float, out: str, port: int,
          patches: list[str], preimports: list[str], timeline: bool = False,
          serve_flags: tuple = (), dtype: str = "") -> int:
    import atexit
    import importlib

    times: dict = {}
    events: Optional[list] = [] if timeline else None
    if timeline:  # read by the parent once this process has ended
        atexit.register(lambda: _dump(sorted(events), out + ".events"))

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

    def on_serve(serve_module) -> None:  # imported when the command imports it, not before
        real_make = serve_module.make_server

        def make_server(*args, **kwargs):  # serve() and the engine-process front both call it
            _write(times, started, out + ".engine")  # phases so far; `ready`: the parent's
            return real_make(*args, **kwargs)

        serve_module.make_server = make_server

    more = _merge_hooks({"tokenweir.server.serve": on_serve,
                         "tokenweir.engine.core_process": lambda m: _core_phases(m, times, out)},
                        {"tokenweir.engine.core_process":
                         lambda m: _core_events(m, events, started, out)} if timeline else {})
    _instrument(times, started, on_engine, events, more)
    from tokenweir.cli import main

    for module in preimports:
        importlib.import_module(module)
    _apply_patches(patches)
    dtype_flag = ["--dtype", dtype] if dtype else []
    if command == "generate":
        args = ["generate", "--model", model, "--max-tokens", "4", *dtype_flag]
        for prompt in PROMPTS:
            args += ["--prompt", prompt]
        return main(args)
    return main(["serve", model, "--port", str(port), "--log-level", "warning", *dtype_flag,
                 *serve_flags])


# ---- parent: runs and the table -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(command: str, model: str, cache_dir: str, patches: list[str],
             extra_env: list[str], preimports: list[str], timeline: bool = False,
             first_request: int = 0, serve_flags: tuple = (), dtype: str = "") -> dict:
    """One start's row of phase times; with timeline, its events under "timeline"."""
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
    cmd += ["--timeline"] if timeline else []
    cmd += [f"--serve-flag={flag}" for flag in serve_flags]
    cmd += ["--dtype", dtype] if dtype else []
    if command == "generate":
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        row = _read_json(out)
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        try:
            ready = _wait_health(port, proc)
            row = {**_read_json(out + ".engine"), **_core_phases_row(out),
                   "ready": ready - started}
            if first_request:
                row["first req"] = _time_request(port, model, first_request)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if timeline:
        core = _read_json(out + ".core") if os.path.exists(out + ".core") else []
        row["timeline"] = sorted(_read_json(out + ".events") + core)
    return row


def _core_phases_row(out: str) -> dict:
    """The engine core process's phases (_core_phases), {} when it wrote none (the in-process
    engine, --no-engine-process: the API process's own file has them)."""
    path = out + ".core-phases"
    if not os.path.exists(path):
        return {}
    row = _read_json(path)
    os.remove(path)
    return row


def format_timeline(events: list) -> str:
    """One line per event: start-end seconds, thread, label (sorted by start)."""
    return "\n".join(f"    {a:6.3f} -{b:6.3f} s  ({b - a:5.3f})  {thread:18} {label}"
                     for a, b, thread, label in events)


def _wait_health(port: int, proc: subprocess.Popen) -> float:
    """When /health first answers 200. Each try is one plain HTTP request (http.client, ~30 us
    of CPU): an httpx.get per try built a client with an SSL context (~46 ms of CPU), so the
    poller took ~70% of a core from the starting server on a 2-core machine."""
    import http.client

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with status {proc.returncode}")
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return time.time()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()
        time.sleep(0.02)


def _time_request(port: int, model: str, prompt_tokens: int) -> float:
    """Seconds to answer one completion of ~prompt_tokens tokens (max_tokens 1)."""
    import httpx

    body = {"model": model, "prompt": "river " * prompt_tokens, "max_tokens": 1}
    sent = time.time()
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120,
                       trust_env=False)
    reply.raise_for_status()
    return time.time() - sent


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
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--first-request", type=int, default=0)
    parser.add_argument("--serve-flag", action="append", default=[])
    parser.add_argument("--dtype", default="", choices=("", "auto", "float32", "bfloat16"))
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args.child, args.model, args.started, args.out, args.port, args.patch,
                       args.preimport, args.timeline, tuple(args.serve_flag), args.dtype))
    print(f"{'command':9} {'start':5} {'run':>3}  " + "  ".join(f"{p:>10}" for p in PHASES)
          + "  dtype")
    for command in args.commands:
        numbers = {"cold": 0, "warm": 0}
        for modes in _schedule(args.repeats, args.warm_only or bool(args.cache_dir)):
            if args.cache_dir:
                modes = modes[1:]  # warm starts only, in the kept directory
            cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tokenweir-startup-cache-")
            try:
                for mode in modes:
                    row = run_once(command, args.model, cache_dir, args.patch, args.env,
                                   args.preimport, args.timeline, args.first_request,
                                   tuple(args.serve_flag), args.dtype)
                    cells = "  ".join(f"{row[p]:>9.2f}s" if p in row else f"{'-':>10}"
                                      for p in PHASES)
                    numbers[mode] += 1
                    print(f"{command:9} {mode:5} {numbers[mode]:>3}  {cells}  "
                          f"{row.get('dtype', '-')}", flush=True)
                    if "timeline" in row:
                        print(format_timeline(row["timeline"]), flush=True)
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
