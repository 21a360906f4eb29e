"""Command line: `tokenweir generate | serve | bench serve | simulate | sweep | calibrate [flags]`.

Engine flags are generated from the config dataclasses (tokenweir/config.py): every field
becomes `--field-name`, with its help text, type and choices. Nothing is mirrored by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from typing import Any, Optional

from tokenweir.config import CONFIG_CLASSES

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a river.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
)


def _field_type(field: dataclasses.Field, owner: type) -> Any:
    hint = typing.get_type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; booleans take `--flag/--no-flag`."""
    for owner in CONFIG_CLASSES:
        group = parser.add_argument_group(owner.__name__)
        for field in dataclasses.fields(owner):
            flag = "--" + field.name.replace("_", "-")
            kind = _field_type(field, owner)
            help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                                   choices=field.metadata.get("choices"), help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user actually gave (the rest keep the dataclass defaults)."""
    names = {f.name for owner in CONFIG_CLASSES for f in dataclasses.fields(owner)}
    return {k: v for k, v in vars(args).items() if k in names}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenweir", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer prompts offline and print a summary")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send prompts raw, no chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--summary", action="store_true", help="print the engine summary")
    add_engine_args(gen)
    from tokenweir.server import cli as server_cli
    from tokenweir.sim import cli as sim_cli
    server_cli.add_subcommands(sub)
    sim_cli.add_subcommands(sub)
    from tokenweir.sim import calibrate
    calibrate.add_subcommand(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenweir import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    kwargs.setdefault("model", "smollm2-135m")
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - started
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    started = time.perf_counter()
    if args.no_chat:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    for prompt, output in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{output.outputs[0].text.strip()}")
    if args.summary:
        print_summary(llm, outputs, seconds, load_seconds)
    return 0


def print_summary(llm, outputs, seconds: float, load_seconds: float) -> None:
    metrics = {m.name.split(":", 1)[1]: m for m in llm.get_metrics()}
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    engine = llm.llm_engine
    print("\n--- tokenweir summary ---")
    print(f"model            {engine.model_name} ({engine.dtype}, {engine.device})")
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


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command in ("serve", "bench"):
        from tokenweir.server import cli as server_cli
        return server_cli.run(args)
    from tokenweir.sim import cli as sim_cli
    if args.command in sim_cli.SIM_COMMANDS:
        return sim_cli.run(args)
    if args.command == "calibrate":
        from tokenweir.sim import calibrate
        return calibrate.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
