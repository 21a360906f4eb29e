"""Offline throughput: tokenweir vs transformers (and optionally vLLM-CPU) on one seeded workload.

Default workload: 64 requests, prompts of 32-1024 random text-token ids (seeded, see
`_workload.py`), 128 greedy output tokens each with EOS ignored, SmolLM2-135M-Instruct
(`smollm2-135m`), float32 on every side by default (`--dtype`). Each system is loaded, warmed up with one tiny request,
then timed over one generate() call (tokenweir, vLLM) or the sequence of static batches
(transformers); loading is not timed. Every request must come back with exactly `output_len`
tokens, or the system is marked INCOMPLETE.

    python benchmarks/offline_throughput.py                 # full run, float32
    python benchmarks/offline_throughput.py --quick         # 8 requests x 16 tokens smoke run
    python benchmarks/offline_throughput.py --peer-vllm /tmp/vllm-venv/bin/python --json out.json

`--peer-vllm` takes the python of a separate virtual environment with vllm-cpu installed (never
the project's). The GGUF is converted once to a float32 safetensors folder under
`--peer-cache-dir`, and vLLM's offline `LLM.generate` runs in a subprocess on the same token-id
prompts with `enable_prefix_caching=False`, the same dtype and, unless `--peer-own-defaults`, the
same `max_num_seqs` / `max_num_batched_tokens` as tokenweir.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))  # the repo root, for `import tokenweir` from a checkout

import _peers  # noqa: E402
import _workload  # noqa: E402
from tokenweir.cpu_info import cpu_model  # noqa: E402

DTYPES = ("bfloat16", "float32", "float16")
TARGET_VS_TRANSFORMERS = 2.0
RESULT_MARKER = "TOKENWEIR_BENCH_RESULT "


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the ones that are None or False (flags, --quick-dependent)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=_HelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--model", default=_workload.DEFAULT_MODEL,
                   help="tokenweir model argument (alias, .gguf file or HF directory)")
    w.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype on every side (float32: on AVX2-only CPUs bfloat16 is ~10x slower)")
    w.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    w.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request, EOS ignored; default 128 (16 with --quick)")
    w.add_argument("--min-prompt-len", type=int, default=32, help="shortest prompt, in tokens")
    w.add_argument("--max-prompt-len", type=int, default=1024, help="longest prompt, in tokens")
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    w.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 16 output tokens")
    w.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed one-request warm-up of each system")

    t = p.add_argument_group("tokenweir")
    t.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of a step")
    t.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    t.add_argument("--kv-cache-space", type=float, default=3.0,
                   help="GiB of KV pool (room for the whole workload at once in float32)")
    t.add_argument("--quantization", choices=("int8",), default=None,
                   help="tokenweir's weight-only int8 decode matmuls (bfloat16; the peer runs "
                        "unquantized: a ratio across precisions, say so when quoting it)")
    t.add_argument("--skip-tokenweir", action="store_true", help="do not run tokenweir")

    h = p.add_argument_group("transformers")
    h.add_argument("--hf-batch-size", type=int, default=16,
                   help="static batch size of transformers generate() (left-padded)")
    h.add_argument("--hf-keep-packed", action="store_true",
                   help="keep GGUF weights packed (transformers' default) instead of loading a "
                        "dense model; without a GGUF kernel this unpacks them in every forward")
    h.add_argument("--skip-transformers", action="store_true", help="do not run transformers")

    v = p.add_argument_group("vLLM peer (optional)")
    v.add_argument("--peer-vllm", metavar="PYTHON", default=None,
                   help="python of a separate venv with vllm-cpu installed; runs the vLLM side")
    v.add_argument("--peer-cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "tokenweir-bench-cache"),
                   help="where the float32 safetensors copy of the model is made once")
    v.add_argument("--peer-kvcache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    v.add_argument("--peer-own-defaults", action="store_true",
                   help="let vLLM pick max_num_seqs / max_num_batched_tokens itself")
    v.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds")

    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 64
    if args.output_len is None:
        args.output_len = 16 if args.quick else 128
    return args


# ----------------------------------------------------------------------------- result records

def new_result(system: str) -> dict[str, Any]:
    return {"system": system, "status": "skipped", "error": None, "load_s": None,
            "seconds": None, "output_tokens": None, "output_tok_s": None, "total_tok_s": None,
            "complete": None, "token_ids": None}


def finish_result(res: dict, wl: _workload.Workload, token_ids: list[list[int]],
                  seconds: float) -> None:
    n_out = sum(len(t) for t in token_ids)
    res["seconds"] = seconds
    res["output_tokens"] = n_out
    res["output_tok_s"] = n_out / seconds
    res["total_tok_s"] = (n_out + wl.num_prompt_tokens) / seconds
    res["complete"] = (len(token_ids) == wl.num_requests
                       and all(len(t) == wl.output_len for t in token_ids))
    res["token_ids"] = token_ids
    res["status"] = "ok" if res["complete"] else "incomplete"
    if not res["complete"]:
        got = sorted({len(t) for t in token_ids})
        res["error"] = (f"{len(token_ids)}/{wl.num_requests} outputs, lengths {got[:8]} "
                        f"(expected {wl.output_len} each)")


def fail_result(res: dict, exc: BaseException) -> None:
    res["status"] = "failed"
    res["error"] = f"{type(exc).__name__}: {exc}"
    traceback.print_exc(file=sys.stderr)


# ----------------------------------------------------------------------------- tokenweir

def single_stream_decode(llm, sampling_params_cls, wl: _workload.Workload) -> float:
    """Decode tokens/s of ONE request alone (the first prompt's first 128 tokens): output_len
    tokens over the time difference between generating output_len + 1 tokens and 1 token
    (so prefill and first-token costs cancel). The same recipe runs in the vLLM subprocess."""
    def timed(n: int) -> float:
        params = sampling_params_cls(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(wl.prompts[0][:128])}], params, use_tqdm=False)
        return time.perf_counter() - t0
    return wl.output_len / (timed(wl.output_len + 1) - timed(1))


def run_tokenweir(args: argparse.Namespace, wl: _workload.Workload) -> dict:
    res = new_result("tokenweir")
    if args.skip_tokenweir:
        return res
    llm = None
    try:
        from tokenweir import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, seed=0,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, kv_cache_space=args.kv_cache_space,
                  quantization=args.quantization)
        res["load_s"] = time.perf_counter() - t0
        if not args.no_warmup:
            llm.generate([{"prompt_token_ids": wl.prompts[0][:32]}],
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
        prompts = [{"prompt_token_ids": list(ids)} for ids in wl.prompts]
        params = SamplingParams(temperature=0, max_tokens=wl.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        finish_result(res, wl, [list(o.outputs[0].token_ids) for o in outs], seconds)
        res["single_stream_decode_tok_s"] = single_stream_decode(llm, SamplingParams, wl)
    except Exception as exc:  # the engine is work in progress: report it, run the rest
        fail_result(res, exc)
    finally:
        if llm is not None:
            for name in ("shutdown", "close"):
                fn = getattr(llm, name, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception:
                        pass
                    break
        del llm
        gc.collect()
    return res


# ----------------------------------------------------------------------------- transformers

def run_transformers(args: argparse.Namespace, wl: _workload.Workload) -> dict:
    res = new_result("transformers")
    if args.skip_transformers:
        return res
    try:
        import torch
        from transformers import AutoModelForCausalLM

        path, kwargs = _workload.resolve_hf_model(args.model)
        if not args.hf_keep_packed:
            kwargs = _workload.dense_gguf_kwargs(kwargs)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, args.dtype), **kwargs).eval()
        res["load_s"] = time.perf_counter() - t0
        pad_id = model.generation_config.pad_token_id
        if pad_id is None:
            pad_id = model.config.eos_token_id
        if isinstance(pad_id, (list, tuple)):
            pad_id = pad_id[0]
        bs = args.hf_batch_size

        @torch.inference_mode()
        def generate(prompts: list[list[int]], n: int, log: bool = False) -> list[list[int]]:
            out: list[list[int]] = []
            t_start = time.perf_counter()
            for i in range(0, len(prompts), bs):
                batch = prompts[i:i + bs]
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, p in enumerate(batch):  # left padding
                    ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
                    mask[row, width - len(p):] = 1
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                                     temperature=None, top_p=None, top_k=None)
                out.extend(gen[:, width:].tolist())
                if log:
                    print(f"[transformers] batch {i // bs + 1}/{-(-len(prompts) // bs)} "
                          f"({len(batch)} x {width} prompt + {n}) done at "
                          f"{time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
            return out

        if not args.no_warmup:
            generate([wl.prompts[0][:32]], 2)
        t0 = time.perf_counter()
        token_ids = generate(wl.prompts, wl.output_len, log=True)
        seconds = time.perf_counter() - t0
        finish_result(res, wl, token_ids, seconds)
        del model
    except Exception as exc:
        fail_result(res, exc)
    gc.collect()
    return res


# ----------------------------------------------------------------------------- vLLM peer

# Runs under the peer venv's python: argv[1] is a JSON config; prints one marked JSON line.
VLLM_SCRIPT = r'''
import json, sys, time


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    from vllm import LLM, SamplingParams
    import vllm

    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], seed=0, enable_prefix_caching=False,
              **cfg["engine_kwargs"])
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids in cfg["prompts"]]
    if cfg["warmup"]:
        llm.generate([{"prompt_token_ids": cfg["prompts"][0][:32]}],
                     SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=cfg["output_len"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in token_ids)
    with open(cfg["tokens_out"], "w") as f:
        json.dump(token_ids, f)

    def timed(n):  # one request alone: the first prompt's first 128 tokens, n output tokens
        one = [{"prompt_token_ids": cfg["prompts"][0][:128]}]
        t = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t
    single = cfg["output_len"] / (timed(cfg["output_len"] + 1) - timed(1))
    print(cfg["marker"] + json.dumps({
        "vllm_version": vllm.__version__, "load_s": load_s, "seconds": seconds,
        "output_tokens": n_out, "output_tok_s": n_out / seconds,
        "single_stream_decode_tok_s": single}), flush=True)


if __name__ == "__main__":
    main()
'''


def run_vllm(args: argparse.Namespace, wl: _workload.Workload) -> dict:
    res = new_result("vLLM-CPU")
    if not args.peer_vllm:
        return res
    try:
        t0 = time.perf_counter()
        model_dir = _workload.hf_float32_dir(args.model, args.peer_cache_dir)
        print(f"[vLLM] model folder {model_dir} (ready in {time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
        env, notes = _peers.vllm_env(args.peer_vllm, args.peer_kvcache_gib)
        for note in notes:
            print(f"[vLLM] warning: {note}", file=sys.stderr, flush=True)
        engine_kwargs = {} if args.peer_own_defaults else {
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
        with tempfile.TemporaryDirectory(prefix="tokenweir-vllm-") as tmp:
            script = os.path.join(tmp, "vllm_offline.py")
            cfg_path = os.path.join(tmp, "config.json")
            tokens_out = os.path.join(tmp, "tokens.json")
            with open(script, "w") as f:
                f.write(VLLM_SCRIPT)
            with open(cfg_path, "w") as f:
                json.dump({"model": model_dir, "dtype": args.dtype, "prompts": wl.prompts,
                           "output_len": wl.output_len, "engine_kwargs": engine_kwargs,
                           "warmup": not args.no_warmup, "tokens_out": tokens_out,
                           "marker": RESULT_MARKER}, f)
            proc = subprocess.run([args.peer_vllm, script, cfg_path], env=env, cwd=tmp,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=args.peer_timeout)
            lines = proc.stdout.splitlines()
            found = [ln for ln in lines if ln.startswith(RESULT_MARKER)]
            if proc.returncode != 0 or not found:
                tail = "\n".join(lines[-40:])
                print(f"[vLLM] subprocess exited {proc.returncode}; last output:\n{tail}",
                      file=sys.stderr, flush=True)
                raise RuntimeError(f"vLLM subprocess exited {proc.returncode} without a result "
                                   f"(last line: {lines[-1] if lines else ''!r})")
            out = json.loads(found[-1][len(RESULT_MARKER):])
            with open(tokens_out) as f:
                token_ids = json.load(f)
        finish_result(res, wl, token_ids, out["seconds"])
        res["load_s"] = out["load_s"]
        res["single_stream_decode_tok_s"] = out.get("single_stream_decode_tok_s")
        res["version"] = out.get("vllm_version")
    except subprocess.TimeoutExpired as exc:
        res["status"] = "failed"
        res["error"] = f"timed out after {exc.timeout:.0f} s"
    except Exception as exc:
        fail_result(res, exc)
    return res


# ----------------------------------------------------------------------------- report

def _ratio(a: dict, b: dict) -> Optional[float]:
    if a["status"] == "ok" and b["status"] == "ok":
        return a["output_tok_s"] / b["output_tok_s"]
    return None


def _agreement(a: dict, b: dict) -> Optional[dict]:
    """How far two systems' greedy outputs agree (they diverge once rounding flips an argmax)."""
    if not (a["token_ids"] and b["token_ids"]) or len(a["token_ids"]) != len(b["token_ids"]):
        return None
    prefixes = []
    for x, y in zip(a["token_ids"], b["token_ids"]):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"identical": sum(x == y for x, y in zip(a["token_ids"], b["token_ids"])),
            "requests": len(prefixes), "mean_common_prefix": sum(prefixes) / len(prefixes)}


def _cpu_capability() -> str:
    import torch
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return "unknown"


# SmolLM2-135M (the default model): 30 layers, hidden 576 (9 x 64 query, 3 x 64 kv), MLP 1536,
# vocabulary 49,152. Matmul FLOPs per token through the decoder, per sampled token in the LM
# head, and attention FLOPs per (query token, context token) pair summed over the layers.
_DECODER_FLOP_PER_TOKEN = 2 * 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
_LM_HEAD_FLOP_PER_SAMPLE = 2 * 576 * 49152
_ATTENTION_FLOP_PER_PAIR = 4 * 30 * 576


def workload_flops(wl: _workload.Workload) -> float:
    """FLOPs the workload needs at least (no recompute): every prompt and output token through
    the decoder, attention over its causal context, the LM head for every sampled token."""
    total = 0.0
    for prompt in wl.prompts:
        n = len(prompt) + wl.output_len
        total += _DECODER_FLOP_PER_TOKEN * n + _ATTENTION_FLOP_PER_PAIR * n * (n + 1) / 2
        total += _LM_HEAD_FLOP_PER_SAMPLE * wl.output_len
    return total


def matmul_peak_gflops(dtype_name: str, repeats: int = 10) -> float:
    """GFLOP/s of a 1024^3 torch matmul in `dtype_name`, best of `repeats`, in this process."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024 ** 3 / best / 1e9


def _print_physical_limit(args: argparse.Namespace, wl: _workload.Workload,
                          results: list[dict]) -> Optional[dict]:
    """The workload's FLOPs over the matmul peak measured now: the fastest any system could go
    on this machine, and each system's share of it."""
    if args.model != _workload.DEFAULT_MODEL:
        return None
    flops, peak = workload_flops(wl), matmul_peak_gflops(args.dtype)
    limit_s = flops / (peak * 1e9)
    out_tokens = wl.output_len * wl.num_requests
    print(f"physical limit: {flops / 1e12:.2f} TFLOP / {peak:.0f} GFLOP/s ({args.dtype} matmul "
          f"peak, measured now) = {limit_s:.2f} s = {out_tokens / limit_s:.0f} output tok/s")
    shares = {}
    for r in results:
        if r["status"] == "ok":
            shares[r["system"]] = limit_s / r["seconds"]
            print(f"  {r['system']}: {100 * shares[r['system']]:.0f}% of the limit")
    return {"workload_tflop": flops / 1e12, "matmul_peak_gflops": peak, "limit_s": limit_s,
            "share_of_limit": shares}


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(args: argparse.Namespace, wl: _workload.Workload, results: list[dict]) -> dict:
    import torch

    by = {r["system"]: r for r in results}
    ratios = {"tokenweir/transformers": _ratio(by["tokenweir"], by["transformers"]),
              "tokenweir/vLLM-CPU": _ratio(by["tokenweir"], by["vLLM-CPU"])}
    agree = {"tokenweir~transformers": _agreement(by["tokenweir"], by["transformers"]),
             "vLLM-CPU~transformers": _agreement(by["vLLM-CPU"], by["transformers"]),
             "tokenweir~vLLM-CPU": _agreement(by["tokenweir"], by["vLLM-CPU"])}

    print()
    print(f"Offline throughput, {args.model}, {args.dtype}: {wl.describe()}")
    print(f"tokenweir: max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"max_num_seqs={args.max_num_seqs}"
          f"{f', quantization={args.quantization}' if args.quantization else ''}"
          f"; transformers: static batches of "
          f"{args.hf_batch_size}, left-padded, {'packed' if args.hf_keep_packed else 'dense'} "
          f"weights; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {_cpu_capability()}")
    header = ("system", "status", "output tokens", "seconds", "output tok/s", "total tok/s",
              "load s")
    rows = []
    for r in results:
        if r["status"] == "skipped":
            continue
        rows.append((r["system"], r["status"], _fmt(r["output_tokens"], ","),
                     _fmt(r["seconds"], ".2f"), _fmt(r["output_tok_s"], ".1f"),
                     _fmt(r["total_tok_s"], ".1f"), _fmt(r["load_s"], ".1f")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in
                     enumerate(zip(header, widths)))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    print()
    for r in results:
        if r["status"] in ("failed", "incomplete"):
            print(f"{r['system']} {r['status']}: {r['error']}")
    for name, value in ratios.items():
        if value is None:
            continue
        extra = ""
        if name == "tokenweir/transformers":
            met = "met" if value >= TARGET_VS_TRANSFORMERS else "NOT met"
            extra = f"   (target >= {TARGET_VS_TRANSFORMERS:g}x: {met})"
        if name == "tokenweir/vLLM-CPU":
            extra = f"   (target >= 1.0x: {'met' if value >= 1.0 else 'NOT met'})"
        print(f"{name}: {value:.2f}x{extra}")
    singles = {r["system"]: r.get("single_stream_decode_tok_s") for r in results
               if r["status"] == "ok" and r.get("single_stream_decode_tok_s")}
    for system, rate in singles.items():
        print(f"single-stream decode {system}: {rate:.1f} tok/s")
    if "tokenweir" in singles and "vLLM-CPU" in singles:
        value = singles["tokenweir"] / singles["vLLM-CPU"]
        print(f"single-stream decode tokenweir/vLLM-CPU: {value:.2f}x   (target >= 1.0x: "
              f"{'met' if value >= 1.0 else 'NOT met'})")
    for name, a in agree.items():
        if a is not None:
            print(f"greedy agreement {name}: {a['identical']}/{a['requests']} requests identical, "
                  f"mean common prefix {a['mean_common_prefix']:.1f}/{wl.output_len} tokens")
    limit = _print_physical_limit(args, wl, results)

    return {
        "benchmark": "offline_throughput",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "workload": wl.summary(),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "cpu_capability": _cpu_capability(), "cpu_model": cpu_model(),
                        "machine": platform.machine(), "platform": platform.platform()},
        "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in results],
        "ratios": ratios,
        "greedy_agreement": agree,
        "physical_limit": limit,
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    wl = _workload.make_workload(args.num_requests, args.min_prompt_len, args.max_prompt_len,
                                 args.output_len, args.seed)
    print(f"workload: {wl.describe()}", file=sys.stderr, flush=True)
    results = []
    for run in (run_tokenweir, run_transformers, run_vllm):
        name = run.__name__[len("run_"):]
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        r = run(args, wl)
        results.append(r)
        print(f"[{name}] {r['status']}"
              + (f": {r['output_tok_s']:.1f} output tok/s" if r["output_tok_s"] else "")
              + (f" ({r['error']})" if r["error"] else ""), file=sys.stderr, flush=True)
    summary = report(args, wl, results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"results written to {args.json}")
    ran = [r for r in results if r["status"] != "skipped"]
    return 0 if ran and all(r["status"] == "ok" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
