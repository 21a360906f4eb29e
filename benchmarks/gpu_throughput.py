"""tokenweir on a GPU vs transformers on the same GPU, in one run, with the roofline of each
workload and the GPU-busy share (issue 33, part 5).

    python benchmarks/gpu_throughput.py                  # a bare H100/H200: < 7 minutes
    python benchmarks/gpu_throughput.py --device cpu --tiny   # a dry run of every code path (s)

No network: each model is built with random weights from a config shipped in the repository
(tokenweir/sim/models/smollm2-135m-instruct.json, benchmarks/gpu_models/qwen3-0.6b.json,
tokenweir/sim/models/llama-3-8b.json), saved as a Hugging Face folder with a word-level
tokenizer of the model's vocabulary (random weights cost exactly what trained ones cost).

Workloads (prompts are token ids, random.Random(seed 0)):
* smollm2-135m: offline W64 and W512 (prompts 64-512 tokens, 128 out), single-stream decode;
* qwen3-0.6b: nano-vllm's benchmark (256 requests, prompts and outputs uniform in 100-1024,
  seed 0; nano-vllm reports 1,434 tok/s on a laptop RTX 4070), single-stream decode;
* llama-3-8b: W256 (prompts 64-512, 128 out) and single-stream decode.

Measured first: the copy bandwidth (a device-to-device copy of 1 GiB: read + write bytes over
time) and the matmul peak (bf16 8192^3). Roofline of a workload: max(FLOPs / matmul peak, bytes
/ bandwidth), FLOPs = 2 x non-embedding parameters x every token + the LM head's 2 x hidden x
vocab per output token + attention's 4 x layers x heads x head_dim x context per token; bytes =
the weights once per decode step (steps = output tokens of the longest-running batch of
max_num_seqs, approximated as outputs x ceil(requests / max_num_seqs)) + every token's K/V
read at every later step. Single stream: bandwidth / (weights + K/V of the context) per token.
GPU busy: CUDA kernel time / wall time of a profiled slice (64 requests x 16 tokens).

Every section has a time cap: a workload that runs past it is stopped, and its rate over the
tokens made so far is printed with `(cut)`; a section that fails prints its error and the
rest still runs. Results also go to --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
SIM_MODELS = ROOT / "tokenweir" / "sim" / "models"
GPU_MODELS = ROOT / "benchmarks" / "gpu_models"
NANO_VLLM_TOK_S = 1434.0  # nano-vllm's README: RTX 4070 laptop, Qwen3-0.6B, this workload
BUSY_CAP_S = 20.0  # the profiled slice
DEADLINE = [float("inf")]  # perf_counter() by which every timed section stops (--budget-s)


def cap(seconds: float) -> float:
    """A section's time cap, never past the run's deadline."""
    return max(1.0, min(seconds, DEADLINE[0] - time.perf_counter()))


@dataclass
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed + 1)
        return [[rng.randrange(10, vocab) for _ in range(n)] for n in self.prompt_lens]


def offline(n: int, lo: int, hi: int, out: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload(f"W{n}", [rng.randint(lo, hi) for _ in range(n)], [out] * n, seed)


def nano_vllm(n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload(f"nano-vllm {n}", [rng.randint(lo, hi) for _ in range(n)],
                    [rng.randint(lo, hi) for _ in range(n)], seed)


@dataclass
class ModelPlan:
    name: str
    config: Path
    workloads: list[Workload]
    single_stream_tokens: int = 128
    transformers_workloads: tuple[str, ...] = ()  # names of the workloads transformers runs
    transformers_single_stream: bool = True  # False: transformers skips the model (time)
    cap_s: float = 60.0  # per workload


def plans(tiny: bool) -> list[ModelPlan]:
    if tiny:
        w = offline(4, 8, 24, 4)
        return [ModelPlan("smollm2-135m", SIM_MODELS / "smollm2-135m-instruct.json", [w], 4,
                          (w.name,), 30.0),
                ModelPlan("qwen3-0.6b", GPU_MODELS / "qwen3-0.6b.json",
                          [nano_vllm(3, 8, 16)], 4, (), 30.0)]
    return [
        ModelPlan("smollm2-135m", SIM_MODELS / "smollm2-135m-instruct.json",
                  [offline(64, 64, 512, 128), offline(512, 64, 512, 128)], 128,
                  ("W64", "W512"), 30.0),
        ModelPlan("qwen3-0.6b", GPU_MODELS / "qwen3-0.6b.json", [nano_vllm()], 128,
                  (), 45.0),
        ModelPlan("llama-3-8b", SIM_MODELS / "llama-3-8b.json", [offline(256, 64, 512, 128)],
                  64, (), transformers_single_stream=False, cap_s=30.0),  # 15 GB via host RAM
    ]


# ---------------------------------------------------------------------------- model build
def hf_config(plan: ModelPlan, tiny: bool):
    import transformers
    raw = {k: v for k, v in json.loads(plan.config.read_text()).items() if not k.startswith("_")}
    if tiny:  # the same family, shrunk: 2 layers, small widths, the real vocabulary
        heads = raw["num_attention_heads"] // math.gcd(raw["num_attention_heads"], 8) or 1
        kv = max(1, min(raw.get("num_key_value_heads", heads), heads))
        while heads % kv:
            kv -= 1
        raw.update(num_hidden_layers=2, hidden_size=heads * 16, intermediate_size=64,
                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
                   vocab_size=min(raw["vocab_size"], 512), max_position_embeddings=4096)
    raw.setdefault("max_position_embeddings", 4096)
    raw["max_position_embeddings"] = max(raw["max_position_embeddings"], 4096)
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **{
        k: v for k, v in raw.items() if k != "architectures"})


def build_model(plan: ModelPlan, folder: str, device: str, dtype, tiny: bool) -> dict:
    import torch
    import transformers
    t0 = time.perf_counter()
    config = hf_config(plan, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size, eos_id=1)
    info = {"params": sum(p.numel() for p in model.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "embedding_params": model.get_input_embeddings().weight.numel(),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            "vocab": config.vocab_size, "tied": bool(config.tie_word_embeddings),
            "build_s": round(time.perf_counter() - t0, 2)}
    del model
    free(device)
    return info


def write_word_tokenizer(folder: str, vocab: int, eos_id: int) -> None:
    """A word-level tokenizer with one token per id ("<t17>"): the engine needs one to
    detokenize; its cost per token is what any detokenizer's is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {f"<t{i}>": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"<t{eos_id}>",
                   "unk_token": "<t0>"}, f)


def free(device: str) -> None:
    """A full collection (a model or engine just dropped may sit in reference cycles), then,
    unless an exception is being handled, the survivors frozen (`gc.freeze`): the next
    collection no longer walks the modules imported so far (transformers' model code,
    torch._dynamo: 0.3-0.6 s a pass, nine passes in a --tiny dry run). What survives here is
    what the run keeps (modules, results); a traceback being handled may hold a model's
    frames, so nothing is frozen then."""
    gc.collect()
    if sys.exc_info()[0] is None:
        gc.freeze()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- machine peaks
def measure_peaks(device: str, tiny: bool) -> dict:
    import torch
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    n = (1 << 28) if device.startswith("cuda") and not tiny else (1 << 22)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)

    def best(fn, reps: int = 5) -> float:
        fn()
        sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)
    copy_s = best(lambda: b.copy_(a))
    size = 8192 if device.startswith("cuda") and not tiny else 512
    x = torch.randn(size, size, dtype=dtype, device=device)
    mm_s = best(lambda: x @ x)
    del a, b, x
    free(device)
    return {"bandwidth_bytes_s": 2 * n * 4 / copy_s, "matmul_flops_s": 2 * size ** 3 / mm_s,
            "matmul_dtype": str(dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------- roofline
def kv_bytes_per_token(info: dict, elem: int) -> int:
    return 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * elem


def roofline_seconds(info: dict, wl: Workload, peaks: dict, max_num_seqs: int,
                     elem: int) -> dict:
    head = 0 if info["tied"] else info["embedding_params"]
    dense = info["params"] - info["embedding_params"] - head  # the LM head: per output token
    tokens = sum(wl.prompt_lens) + wl.output_tokens
    ctx_sum = sum(p * o + o * (o + 1) // 2 for p, o in zip(wl.prompt_lens, wl.output_lens))
    ctx_sum += sum(p * (p + 1) // 2 for p in wl.prompt_lens)
    attn_per_ctx = 4 * info["layers"] * info["heads"] * info["head_dim"]
    flops = (2 * max(dense, 0) * tokens + 2 * info["hidden"] * info["vocab"] * wl.output_tokens
             + attn_per_ctx * ctx_sum)
    steps = max(wl.output_lens) * math.ceil(wl.num_requests / max_num_seqs)
    kv_read = kv_bytes_per_token(info, elem) * sum(
        p * o + o * (o + 1) // 2 for p, o in zip(wl.prompt_lens, wl.output_lens))
    bytes_moved = info["weight_bytes"] * steps + kv_read
    compute_s = flops / peaks["matmul_flops_s"]
    memory_s = bytes_moved / peaks["bandwidth_bytes_s"]
    return {"flops": flops, "bytes": bytes_moved, "compute_s": compute_s, "memory_s": memory_s,
            "floor_s": max(compute_s, memory_s)}


def single_stream_floor(info: dict, prompt: int, tokens: int, peaks: dict, elem: int) -> float:
    """Tokens/s when every decode step reads the weights and the context's K/V once."""
    ctx = prompt + tokens / 2
    per_token = info["weight_bytes"] + kv_bytes_per_token(info, elem) * ctx
    return peaks["bandwidth_bytes_s"] / per_token


# ---------------------------------------------------------------------------- tokenweir
def run_engine(llm, prompts: list[list[int]], output_lens: list[int], cap_s: float) -> dict:
    """All requests at once; steps until done or `cap_s`. Returns tokens, seconds, steps."""
    from tokenweir import SamplingParams
    engine = llm.llm_engine
    ids = []
    for prompt, out in zip(prompts, output_lens):
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        request, text = engine.make_request({"prompt_token_ids": prompt}, params)
        ids.append(request.request_id)
        engine.add_request(request, text)
    made: dict[str, int] = {}
    steps, cut = 0, False
    cap_s = cap(cap_s)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=True):  # as LLM.generate steps
            made[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        if time.perf_counter() - t0 > cap_s:
            cut = True
            for rid, state in engine.outputs.states.items():  # the unfinished ones so far
                made[rid] = len(state.request.output_token_ids)
            engine.abort_requests(ids)
            break
    seconds = time.perf_counter() - t0
    return {"output_tokens": sum(made.values()), "seconds": seconds, "steps": steps, "cut": cut}


def gpu_busy_share(llm, prompts: list[list[int]], device: str) -> Optional[float]:
    """CUDA kernel time / wall time of 64 requests x 16 tokens under torch.profiler."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_engine(llm, prompts[:64], [16] * min(64, len(prompts)), BUSY_CAP_S)
        sync(device)
        wall = time.perf_counter() - t0
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return kernel_us / 1e6 / wall


def single_stream(llm, prompt: list[int], tokens: int, device: str) -> float:
    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        run_engine(llm, [prompt], [n], 120.0)
        sync(device)
        return time.perf_counter() - t0
    timed(2)
    return tokens / (timed(tokens + 1) - timed(1))


def run_tokenweir(plan: ModelPlan, folder: str, info: dict, args, dtype_name: str) -> dict:
    from tokenweir import LLM
    res: dict[str, Any] = {}
    max_seqs = max(wl.num_requests for wl in plan.workloads)
    longest = max(p + o for wl in plan.workloads for p, o in zip(wl.prompt_lens,
                                                                  wl.output_lens))
    t0 = time.perf_counter()
    llm = LLM(model=folder, device=args.device, dtype=dtype_name, seed=0,
              max_model_len=max(longest + 8, 256), max_num_seqs=max_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_space=kv_space_gib(args, info))
    res["load_s"] = round(time.perf_counter() - t0, 2)
    res["attention_backend"] = getattr(llm.llm_engine.core.executor.attention_backend,
                                       "name", "cpu")
    try:
        warm = plan.workloads[0].prompts(info["vocab"])[:4]
        run_engine(llm, [p[:32] for p in warm], [4] * len(warm), 60.0)
        for wl in plan.workloads:
            got = run_engine(llm, wl.prompts(info["vocab"]), wl.output_lens, plan.cap_s)
            got["tok_s"] = got["output_tokens"] / got["seconds"]
            got["ms_per_step"] = got["seconds"] * 1e3 / max(got["steps"], 1)
            res[wl.name] = got
        prompts = plan.workloads[0].prompts(info["vocab"])
        res["gpu_busy"] = gpu_busy_share(llm, prompts, args.device)
        res["single_stream_tok_s"] = single_stream(llm, prompts[0][:128],
                                                   plan.single_stream_tokens, args.device)
    finally:
        llm.llm_engine.close() if hasattr(llm.llm_engine, "close") else None
        del llm
        free(args.device)
    return res


def kv_space_gib(args, info: dict) -> float:
    if not args.device.startswith("cuda"):
        return 0.25
    import torch
    free_bytes, _ = torch.cuda.mem_get_info()
    return max(1.0, (0.6 * free_bytes - info["weight_bytes"]) / 2 ** 30)


# ---------------------------------------------------------------------------- transformers
def run_transformers(plan: ModelPlan, folder: str, info: dict, args, dtype) -> dict:
    import torch
    import transformers
    res: dict[str, Any] = {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(
        args.device).eval()
    try:
        for wl in plan.workloads:
            if wl.name in plan.transformers_workloads:
                res[wl.name] = hf_generate(model, wl.prompts(info["vocab"]), wl.output_lens,
                                           args.device, plan.cap_s, args.hf_batch)
        prompt = plan.workloads[0].prompts(info["vocab"])[0][:128]
        n = plan.single_stream_tokens
        t1 = hf_generate(model, [prompt], [1], args.device, 60.0, 1)["seconds"]
        tn = hf_generate(model, [prompt], [n + 1], args.device, 120.0, 1)["seconds"]
        res["single_stream_tok_s"] = n / (tn - t1)
    finally:
        del model
        free(args.device)
    return res


def hf_generate(model, prompts: list[list[int]], output_lens: list[int], device: str,
                cap_s: float, batch: int) -> dict:
    """Static batches of `batch`, left-padded, greedy, exactly output_len tokens each."""
    import torch
    cap_s = cap(cap_s)
    made, t0, cut = 0, time.perf_counter(), False
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            out_len = max(output_lens[start:start + batch])
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                                device=device)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
            sync(device)
            made += sum(output_lens[start:start + batch])
            if time.perf_counter() - t0 > cap_s and start + batch < len(prompts):
                cut = True
                break
    seconds = time.perf_counter() - t0
    return {"output_tokens": made, "seconds": seconds, "tok_s": made / seconds, "cut": cut}


# ---------------------------------------------------------------------------- report
def fmt(v: Optional[float], spec: str = ",.1f") -> str:
    return "-" if v is None else format(v, spec)


def report_model(name: str, info: dict, tw: dict, hf: dict, peaks: dict, plan: ModelPlan,
                 elem: int, max_num_seqs: int) -> list[str]:
    lines = [f"\n== {name}: {info['params'] / 1e6:,.1f} M parameters, "
             f"{info['weight_bytes'] / 1e9:.2f} GB, built in {info['build_s']} s; tokenweir "
             f"load {tw.get('load_s', '-')} s, attention backend {tw.get('attention_backend')}",
             f"{'workload':<16}{'tokenweir tok/s':>16}{'ms/step':>9}{'transformers':>14}"
             f"{'ratio':>7}{'roofline tok/s':>16}{'share':>7}"]
    for wl in plan.workloads:
        mine, theirs = tw.get(wl.name, {}), hf.get(wl.name, {})
        roof = roofline_seconds(info, wl, peaks, max_num_seqs, elem)
        roof_tok_s = wl.output_tokens / roof["floor_s"]
        rate = mine.get("tok_s")
        ratio = rate / theirs["tok_s"] if rate and theirs.get("tok_s") else None
        lines.append(f"{wl.name:<16}{fmt(rate):>16}{'(cut)' if mine.get('cut') else '':>0}"
                     f"{fmt(mine.get('ms_per_step'), '.2f'):>9}{fmt(theirs.get('tok_s')):>14}"
                     f"{fmt(ratio, '.2f'):>7}{fmt(roof_tok_s):>16}"
                     f"{fmt(rate / roof_tok_s * 100 if rate else None, '.1f'):>6}%")
        lines.append(f"{'':<16}roofline: {roof['flops'] / 1e12:,.2f} TFLOP "
                     f"({roof['compute_s']:.3f} s), {roof['bytes'] / 1e9:,.2f} GB "
                     f"({roof['memory_s']:.3f} s)")
        if wl.name.startswith("nano-vllm"):
            lines.append(f"{'':<16}nano-vllm's own figure (RTX 4070 laptop): "
                         f"{NANO_VLLM_TOK_S:,.0f} tok/s")
    floor = single_stream_floor(info, 128, plan.single_stream_tokens, peaks, elem)
    s = tw.get("single_stream_tok_s")
    lines.append(f"{'single stream':<16}{fmt(s):>16}{'':>9}"
                 f"{fmt(hf.get('single_stream_tok_s')):>14}"
                 f"{fmt(s / hf['single_stream_tok_s'] if s and hf.get('single_stream_tok_s') else None, '.2f'):>7}"
                 f"{fmt(floor):>16}{fmt(s / floor * 100 if s else None, '.1f'):>6}%")
    busy = tw.get("gpu_busy")
    lines.append(f"GPU busy (CUDA kernel time / wall, 64 requests x 16 tokens): "
                 f"{fmt(busy * 100 if busy is not None else None, '.1f')}%")
    return lines


def environment(device: str) -> dict:
    import torch
    env = {"torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (with --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="shrunk models and workloads: checks every code path in seconds")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of smollm2-135m,qwen3-0.6b,llama-3-8b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="timed sections stop by this many seconds after the start (a model "
                        "not started by then is skipped): the whole run ends within ~7 min")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    DEADLINE[0] = time.perf_counter() + args.budget_s
    import torch
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    env = environment(args.device)
    print("environment:", json.dumps(env), flush=True)
    peaks = measure_peaks(args.device, args.tiny)
    print(f"copy bandwidth {peaks['bandwidth_bytes_s'] / 1e9:,.0f} GB/s, matmul "
          f"({peaks['matmul_dtype']}) {peaks['matmul_flops_s'] / 1e12:,.3f} TFLOP/s", flush=True)
    results: dict[str, Any] = {"environment": env, "peaks": peaks, "models": {}}
    wanted = set(args.models.split(",")) if args.models else None
    failures = 0
    for plan in plans(args.tiny):
        if wanted and plan.name not in wanted:
            continue
        if time.perf_counter() > DEADLINE[0] - 20:
            print(f"\n== {plan.name}: skipped (the --budget-s is spent)", flush=True)
            continue
        entry: dict[str, Any] = {}
        results["models"][plan.name] = entry
        with tempfile.TemporaryDirectory(prefix=f"tw-{plan.name}-") as folder:
            try:
                info = entry["info"] = build_model(plan, folder, args.device, dtype, args.tiny)
                entry["tokenweir"] = run_tokenweir(plan, folder, info, args, dtype_name)
                skip_hf = args.skip_transformers or not (plan.transformers_workloads
                                                         or plan.transformers_single_stream)
                entry["transformers"] = ({} if skip_hf else
                                         run_transformers(plan, folder, info, args, dtype))
                max_seqs = max(wl.num_requests for wl in plan.workloads)
                print("\n".join(report_model(plan.name, info, entry["tokenweir"],
                                             entry["transformers"], peaks, plan, elem,
                                             max_seqs)), flush=True)
            except Exception as exc:  # report it and run the rest
                failures += 1
                entry["error"] = f"{type(exc).__name__}: {exc}"
                print(f"\n== {plan.name}: FAILED: {entry['error']}", flush=True)
                traceback.print_exc()
            free(args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
