"""One request under different schedules (issue 38): what it says alone, and what it says (b) in
a batch of 64, (c) chunked at 16/64/256 tokens, (d) behind a cached prefix, (e) preempted by
recompute and by swap, (f) as sample i of n = 8. Each scenario returns the target's outputs
(token ids and the sampled tokens' logprobs, as exact floats) and a probe saying that the
condition really happened (the chunk sizes seen, cached tokens, preemptions, swaps, samples).

Used by tests/engine/test_batch_invariance.py and, run as a script, prints which scenarios
change the outputs today (`python tests/engine/invariance_scenarios.py`), and which op causes
it (`... --attribution`).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tokenweir import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
PROMPT_LEN = 300  # longer than the largest chunk (256), so every chunk size cuts it
MAX_TOKENS = 10
N_SAMPLES = 8
SEED = 1234
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=SEED, max_tokens=MAX_TOKENS,
                        ignore_eos=True, logprobs=2)
ROOMY = dict(device="cpu", max_model_len=512, block_size=16, max_num_batched_tokens=512,
             enable_prefix_caching=False, swap_space=0.01, num_gpu_blocks_override=400)


def make_model(path: str) -> str:
    """The wide tiny Llama (K = 512 > a packed-kernel k block) with a tokenizer, at path."""
    make_tiny_model("llama_wide", path, seed=7)
    save_tiny_tokenizer(path, TEMPLATE)
    return path


def prompt_ids(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


@dataclass
class Outcome:
    """The target's samples (one per sample of the request: (token ids, sampled logprobs))
    and what the probe saw."""

    samples: list[tuple[list[int], list[float]]]
    probe: dict[str, Any] = field(default_factory=dict)


class StepLog:
    """Wraps the engine's executor: per step, the tokens each request was scheduled."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.core
        self.execute, core.executor.execute = core.executor.execute, self._execute
        self.steps: list[dict[str, int]] = []
        self.swapped_out = 0

    def _execute(self, out):
        self.steps.append(dict(out.num_scheduled_tokens))
        self.swapped_out += len(out.blocks_to_swap_out)
        return self.execute(out)

    def chunks(self, req_id: str) -> list[int]:
        return [s[req_id] for s in self.steps if req_id in s]

    def largest_step_with(self, req_id: str) -> int:
        return max(len(s) for s in self.steps if req_id in s)


def _samples(output) -> list[tuple[list[int], list[float]]]:
    """Per sample: its token ids, and every logprob reported (the sampled token's and the top
    2's, each position in token-id order), as exact floats."""
    return [(list(c.token_ids), [lp.logprob for d in c.logprobs for _, lp in sorted(d.items())])
            for c in sorted(output.outputs, key=lambda c: c.index)]


_LOADED: dict[tuple[str, str, str], Any] = {}


def _loaded(path: str, dtype: str):
    """The model at path in dtype, loaded once per process and shared by every engine (each
    engine sets its own batch_invariant on it when built, and is used before the next)."""
    device = ROOMY["device"]  # cpu; a test may set cuda
    if (path, dtype, device) not in _LOADED:
        import torch

        from tokenweir.model.loader import load_model
        _LOADED[(path, dtype, device)] = load_model(path, getattr(torch, dtype),
                                                    torch.device(device))
    return _LOADED[(path, dtype, device)]


def _engine(path: str, dtype: str, invariant: bool, **overrides) -> tuple[LLM, StepLog]:
    from tokenweir.config import EngineConfig
    from tokenweir.engine.llm_engine import LLMEngine
    config = EngineConfig.from_kwargs(model=path, dtype=dtype, batch_invariant=invariant,
                                      **{**ROOMY, **overrides})
    llm = LLM.from_engine(LLMEngine(config, loaded=_loaded(path, dtype)))
    return llm, StepLog(llm)


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "tokenweir:" + name)


def alone(path: str, dtype: str, invariant: bool, params: SamplingParams) -> Outcome:
    llm, log = _engine(path, dtype, invariant)
    out = llm.generate([{"prompt_token_ids": prompt_ids(0)}], params, use_tqdm=False)[0]
    return Outcome(_samples(out), {"chunks": log.chunks(out.request_id)})


def in_batch_of_64(path: str, dtype: str, invariant: bool, params: SamplingParams) -> Outcome:
    """The target with 63 others (prompts of 8-120 tokens), all admitted at once."""
    llm, log = _engine(path, dtype, invariant, max_num_batched_tokens=2048)
    others = [{"prompt_token_ids": prompt_ids(100 + i, random.Random(i).randint(8, 40))}
              for i in range(63)]
    outs = llm.generate([{"prompt_token_ids": prompt_ids(0)}] + others, params, use_tqdm=False)
    return Outcome(_samples(outs[0]), {"largest_step": log.largest_step_with(outs[0].request_id)})


def chunked(chunk: int) -> Callable[..., Outcome]:
    def run(path: str, dtype: str, invariant: bool, params: SamplingParams) -> Outcome:
        llm, log = _engine(path, dtype, invariant, max_num_batched_tokens=max(chunk, 32),
                           long_prefill_token_threshold=chunk)
        outs = llm.generate([{"prompt_token_ids": prompt_ids(0)},
                             {"prompt_token_ids": prompt_ids(1, 40)}], params, use_tqdm=False)
        return Outcome(_samples(outs[0]), {"chunks": log.chunks(outs[0].request_id)})
    run.__name__ = f"chunked_{chunk}"
    return run


def behind_cached_prefix(path: str, dtype: str, invariant: bool,
                         params: SamplingParams) -> Outcome:
    """A first request shares the target's first 200 tokens; the target then reuses them."""
    llm, _ = _engine(path, dtype, invariant, enable_prefix_caching=True)
    target = prompt_ids(0)
    llm.generate([{"prompt_token_ids": target[:200] + prompt_ids(5, 30)}], params,
                 use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0]
    return Outcome(_samples(out), {"cached_tokens": out.num_cached_tokens})


def preempted(mode: str) -> Callable[..., Outcome]:
    def run(path: str, dtype: str, invariant: bool, params: SamplingParams) -> Outcome:
        """Four requests of 120 tokens (8 blocks, 9 once decoding) in a pool of 19: decodes
        run out of blocks and the latest admitted are preempted."""
        llm, log = _engine(path, dtype, invariant, num_gpu_blocks_override=20, max_model_len=304,
                           preemption_mode=mode, max_num_batched_tokens=128,
                           scheduler_reserve_full_isl=False)
        prompts = [{"prompt_token_ids": prompt_ids(200 + i, 120)} for i in range(4)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        victims = [i for i, o in enumerate(outs) if o.metrics.num_preemptions > 0]
        target = outs[victims[0]] if victims else outs[0]
        ref = prompts[victims[0]] if victims else prompts[0]
        return Outcome(_samples(target), {"preempted": len(victims),
                                          "swapped_blocks": log.swapped_out,
                                          "prompt": ref["prompt_token_ids"]})
    run.__name__ = f"preempted_{mode}"
    return run


SCENARIOS: list[Callable[..., Outcome]] = [
    in_batch_of_64, chunked(16), chunked(64), chunked(256), behind_cached_prefix,
    preempted("recompute"), preempted("swap")]


def alone_with(path: str, dtype: str, invariant: bool, params: SamplingParams,
               prompt: list[int]) -> Outcome:
    llm, _ = _engine(path, dtype, invariant)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return Outcome(_samples(out))


def parallel_samples(path: str, dtype: str, invariant: bool) -> tuple[Outcome, list[Outcome]]:
    """(f): the seeded request with n = 8, and each sample as a lone request seeded SEED + i."""
    llm, _ = _engine(path, dtype, invariant)
    group = SamplingParams(n=N_SAMPLES, temperature=1.0, top_p=0.9, seed=SEED,
                           max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    prompt = [{"prompt_token_ids": prompt_ids(0)}]
    together = Outcome(_samples(llm.generate(prompt, group, use_tqdm=False)[0]))
    lone = []
    for i in range(N_SAMPLES):
        single = SamplingParams(temperature=1.0, top_p=0.9, seed=SEED + i, max_tokens=MAX_TOKENS,
                                ignore_eos=True, logprobs=2)
        lone.append(Outcome(_samples(llm.generate(prompt, single, use_tqdm=False)[0])))
    return together, lone


def reference_for(scenario: Callable[..., Outcome], outcome: Outcome, path: str, dtype: str,
                  invariant: bool, params: SamplingParams, cache: dict) -> Outcome:
    """What the scenario's target says alone (a preempted victim may be another prompt)."""
    prompt = outcome.probe.get("prompt", prompt_ids(0))
    key = (dtype, invariant, id(params), tuple(prompt))
    if key not in cache:
        cache[key] = alone_with(path, dtype, invariant, params, prompt)
    return cache[key]


def causes_table(path: str) -> None:  # pragma: no cover - a report, run by hand
    """Which scenarios change the target today, per dtype and sampling, with the flag off."""
    import time
    cache: dict = {}
    for dtype in ("float32", "bfloat16"):
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            for scenario in SCENARIOS:
                for invariant in (False, True):
                    t0 = time.perf_counter()
                    got = scenario(path, dtype, invariant, params)
                    ref = reference_for(scenario, got, path, dtype, invariant, params, cache)
                    print(f"{dtype:9s} {name:7s} {scenario.__name__:22s} "
                          f"invariant={invariant!s:5s} {_verdict(got, ref):32s} "
                          f"probe={ {k: v for k, v in got.probe.items() if k != 'prompt'} } "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)
        for invariant in (False, True):
            together, lone = parallel_samples(path, dtype, invariant)
            diff = sum(a != b.samples[0] for a, b in zip(together.samples, lone))
            print(f"{dtype:9s} seeded  n8_vs_seed_plus_i        invariant={invariant!s:5s} "
                  f"{diff} of {N_SAMPLES} samples differ", flush=True)


def attribution_table(path: str) -> None:  # pragma: no cover - a report, run by hand
    """Which op moves the outputs: each scenario (greedy) with only the matmuls invariant, and
    with only the attention invariant (the runner's switch patched), against the same mode's
    alone. Norms, activations and RoPE are per-row kernels already; sampling is per-row by
    design (model/sampler.py): with both ops invariant nothing moves (causes_table)."""
    from unittest import mock

    from tokenweir.runner import model_runner
    modes = {"matmuls only": (True, False), "attention only": (False, True)}
    for dtype in ("float32", "bfloat16"):
        for mode, (engine_flag, attention_flag) in modes.items():
            with mock.patch.object(model_runner, "batch_invariant",
                                   lambda model, on=attention_flag: on):
                cache: dict = {}
                for scenario in SCENARIOS:
                    got = scenario(path, dtype, engine_flag, GREEDY)
                    ref = reference_for(scenario, got, path, dtype, engine_flag, GREEDY, cache)
                    print(f"{dtype:9s} {mode:15s} {scenario.__name__:22s} "
                          f"{_verdict(got, ref)}", flush=True)
                together, lone = parallel_samples(path, dtype, engine_flag)
                diff = sum(a != b.samples[0] for a, b in zip(together.samples, lone))
                print(f"{dtype:9s} {mode:15s} n8_vs_seed_plus_i      {diff} of {N_SAMPLES} "
                      f"samples differ", flush=True)


def _verdict(got: Outcome, ref: Outcome) -> str:
    (tokens, lps), (rtokens, rlps) = got.samples[0], ref.samples[0]
    if tokens != rtokens:
        first = next(i for i, (a, b) in enumerate(zip(tokens, rtokens)) if a != b)
        return f"TOKENS differ from #{first}"
    if lps != rlps:
        return f"logprobs differ (max {max(abs(a - b) for a, b in zip(lps, rlps)):.1e})"
    return "identical"


if __name__ == "__main__":  # pragma: no cover
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        model_path = make_model(tmp)
        if "--attribution" in sys.argv:
            attribution_table(model_path)
        else:
            causes_table(model_path)
