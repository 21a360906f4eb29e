"""`tokenweir generate`: answer prompts offline with the real engine and print the answers
(and, with --summary, what the engine did)."""

from __future__ import annotations

import argparse
import time

from tokenweir.config import DEFAULT_MODEL, ENGINE_FIELD_NAMES, EngineConfig, engine_kwargs

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a river.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
)


# GenerateConfig fields a refusal may name (as well as the engine's)
_FLAG_FIELDS = ENGINE_FIELD_NAMES | {"temperature", "top_p", "top_k", "max_tokens"}


def run(args: argparse.Namespace) -> int:
    from tokenweir import startup_gc

    with startup_gc.paused():  # imports and the build: no collector passes (startup_gc.py)
        built = _start(args)
    if isinstance(built, int):
        return built
    llm, params, load_seconds = built
    from tokenweir.usage_errors import refuse

    prompts = args.prompt or list(DEFAULT_PROMPTS)
    started = time.perf_counter()
    try:
        if args.no_chat:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
    except ValueError as exc:  # a request refused (e.g. --max-tokens beyond the context)
        return refuse("generate", exc, _FLAG_FIELDS)
    seconds = time.perf_counter() - started
    for prompt, output in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{output.outputs[0].text.strip()}")
    if args.summary:
        print_summary(llm, outputs, seconds, load_seconds)
    llm.llm_engine.close()  # writes the end of a --trace file and its Chrome form
    return 0


def _start(args: argparse.Namespace):
    """(LLM, SamplingParams, load seconds), or the exit status of a refusal."""
    from tokenweir import SamplingParams
    from tokenweir.usage_errors import refuse
    from tokenweir.engine.preflight import check_before_load

    kwargs = engine_kwargs(args)
    kwargs.setdefault("model", DEFAULT_MODEL)
    try:  # everything that can be refused without the model, before torch is imported
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, max_tokens=args.max_tokens)
        config = EngineConfig.from_kwargs(**kwargs)
        check_before_load(config)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return refuse("generate", exc, _FLAG_FIELDS)
    from tokenweir.model import prefetch
    # the load cache checked while torch imports
    prefetch.start_for_model(kwargs["model"], config.model.dtype, config.model.device)
    from tokenweir.engine.llm import LLM
    from tokenweir.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    try:  # no CPU warm-up: this one batch is the first request, it would pay the same once
        llm = LLM.from_engine(LLMEngine(EngineConfig.from_kwargs(**kwargs), cpu_warm_up=False))
    except ValueError as exc:  # what only the load can tell (e.g. a --kv-cache-space pool)
        return refuse("generate", exc, _FLAG_FIELDS)
    return llm, params, time.perf_counter() - started


def dtype_line(engine) -> str:
    """Which dtype runs and why: the auto choice's reason, or 'set by --dtype'."""
    from tokenweir.model.loader import dtype_choice

    name = str(engine.dtype).replace("torch.", "")
    if engine.config.model.dtype != "auto":
        return f"{name} (set by --dtype {engine.config.model.dtype})"
    return f"{name} (auto: {dtype_choice(engine.device)[1]})"


def print_summary(llm, outputs, seconds: float, load_seconds: float) -> None:
    metrics = {m.name.split(":", 1)[1]: m for m in llm.get_metrics()}
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    engine = llm.llm_engine
    print("\n--- tokenweir summary ---")
    print(f"model            {engine.model_name} ({engine.dtype}, {engine.device})")
    print(f"dtype            {dtype_line(engine)}")
    print(f"load time        {load_seconds:.1f} s")
    print(f"requests         {len(outputs)}  prompt tokens {prompt_tokens}  "
          f"generated tokens {generated}")
    print(f"generate time    {seconds:.2f} s  ->  {generated / seconds:.1f} output tok/s, "
          f"{(generated + prompt_tokens) / seconds:.1f} total tok/s")
    print(f"engine steps     {metrics['num_steps'].value}")
    print(f"preemptions      {metrics['num_preemptions'].value}")
    print(f"chunked prefills {metrics['num_chunked_prefills'].value}")
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    print(f"mean TTFT        {1000 * sum(ttfts) / len(ttfts):.0f} ms")
