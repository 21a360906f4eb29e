"""`tokenweir bench serve`: a seeded streaming load test against any OpenAI-compatible server,
reporting as `vllm bench serve` does (throughput, TTFT, TPOT, ITL, E2EL, goodput)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np


def add_args(p: argparse.ArgumentParser, require_target: bool = True) -> None:
    p.add_argument("--base-url", required=require_target, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=require_target)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default=None, help="JSONL with a 'prompt' field per line")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--length-dist", choices=("fixed", "uniform", "lognormal"), default="fixed")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="uniform: lengths in len*(1±ratio); lognormal: sigma")
    p.add_argument("--vocab-size", type=int, default=30000,
                   help="random prompt token ids are drawn below this")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs like ttft:500 tpot:50 (ms)")
    p.add_argument("--save-result", default=None, help="write the result JSON here")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")


@dataclass
class WorkItem:
    prompt: object  # str or list of token ids
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    error: str = ""


def _lengths(rng: np.random.Generator, mean: int, n: int, dist: str, ratio: float) -> list[int]:
    if dist == "fixed":
        values = np.full(n, mean)
    elif dist == "uniform":
        values = rng.integers(max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio)) + 1, n)
    else:
        values = rng.lognormal(np.log(mean) - ratio ** 2 / 2, ratio, n)
    return [max(1, int(v)) for v in values]


def make_workload(args: argparse.Namespace) -> list[WorkItem]:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    outs = _lengths(rng, args.output_len, n, args.length_dist, args.range_ratio)
    if args.dataset:
        with open(args.dataset) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        return [WorkItem(prompts[i % len(prompts)], 0, outs[i]) for i in range(n)]
    ins = _lengths(rng, args.input_len, n, args.length_dist, args.range_ratio)
    return [WorkItem([int(t) for t in rng.integers(100, args.vocab_size, k)], k, o)
            for k, o in zip(ins, outs)]


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)
    theta = 1.0 / (rate * burstiness)
    return list(rng.gamma(burstiness, theta, n))


async def send_one(client, url: str, model: str, item: WorkItem, headers: dict,
                   chat: bool) -> RequestResult:
    result = RequestResult(prompt_len=item.prompt_len)
    body = {"model": model, "max_tokens": item.output_len, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": item.prompt if isinstance(item.prompt, str)
                             else " ".join(map(str, item.prompt))}]
    else:
        body["prompt"] = item.prompt
    start = time.perf_counter()
    last = start
    pieces = 0  # text chunks: the output length when the server reports no usage
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                piece = c.get("text") if not chat else (c.get("delta") or {}).get("content")
                if not piece:
                    continue
                pieces += 1
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or pieces
        result.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm import tqdm

    items = make_workload(args)
    gaps = arrival_gaps(len(items), args.request_rate, args.burstiness, args.seed)
    url = args.base_url.rstrip("/") + args.endpoint
    chat = "chat" in args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or len(items) or 1)
    bar = tqdm(total=len(items), disable=args.no_progress, desc="requests")
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000,
                          max_keepalive_connections=args.max_concurrency or 1000)

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, trust_env=False) as client:
        async def one(item: WorkItem) -> RequestResult:
            async with limit:
                r = await send_one(client, url, args.model, item, headers, chat)
            bar.update(1)
            return r

        started = time.perf_counter()
        tasks = []
        for item, gap in zip(items, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(item)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    bar.close()
    return summarize(results, duration, args)


def _stats(values: list[float], percentiles: list[float], name: str) -> dict:
    arr = np.asarray(values or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def parse_goodput(specs: list[str]) -> dict[str, float]:
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad --goodput entry {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value) / 1000
    return slos


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.success]
    percentiles = [float(p) for p in str(args.percentiles).split(",") if p]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    slos = parse_goodput(args.goodput)
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if (r.ttft <= slos.get("ttft", float("inf")) and tpot <= slos.get("tpot", float("inf"))
                and r.latency <= slos.get("e2el", float("inf"))):
            good += 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    result = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.success][:10],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "request_goodput": good / duration if slos and duration else None,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
    }
    result.update(_stats([r.ttft for r in ok], percentiles, "ttft"))
    result.update(_stats(tpots, percentiles, "tpot"))
    result.update(_stats([x for r in ok for x in r.itl], percentiles, "itl"))
    result.update(_stats([r.latency for r in ok], percentiles, "e2el"))
    return result


def print_report(result: dict, percentiles: str) -> None:
    line = "=" * 50
    print(f"{line}\n{' Serving Benchmark Result ':=^50}")
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", f"{result['duration']:.2f}"),
            ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{f' {title} ':-^50}")
        print(f"{f'Mean {name.upper()} (ms):':<40}{result[f'mean_{name}_ms']:<10.2f}")
        print(f"{f'Median {name.upper()} (ms):':<40}{result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles.split(","):
            if p:
                key = f"p{float(p):g}_{name}_ms"
                print(f"{f'P{float(p):g} {name.upper()} (ms):':<40}{result[key]:<10.2f}")
    print(line)
    for err in result["errors"][:3]:
        print("error:", err)


def main(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    parse_goodput(args.goodput)  # fail fast on a typo
    result = asyncio.run(run_benchmark(args))
    print_report(result, args.percentiles)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] else 1
