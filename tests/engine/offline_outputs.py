"""A fixed offline workload whose token ids and texts must not change when the host side of a
step is made cheaper (issue 33, host6): `LLM.generate` (final-only steps) and
`LLMEngine.step` driven in mixed modes (final-only steps, then full outputs, then final-only
again), on the tiny Llama with the tiny byte-level BPE (multi-byte characters split across
tokens: é, 東京, 🤗). Greedy and seeded sampling, stop strings, parallel sampling (n=2, and
best_of), penalties, logprobs, EOS and length endings, a request aborted mid-way.

`python tests/engine/offline_outputs.py` re-records offline_outputs.json (recorded on main
495a511, before deferred detokenisation; see test_offline_outputs.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tokenweir import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

GOLDEN = Path(__file__).with_name("offline_outputs.json")
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8,
              num_gpu_blocks_override=400, max_num_batched_tokens=96, seed=3)
TEXTS = ["the quick brown fox", "naïve café — 東京 🤗 emoji", "hello world, hello tokens",
         "paged attention with a block table", "東京 🤗", "café"]


def params_list() -> list[SamplingParams]:
    """One SamplingParams per prompt of the workload (cycled over TEXTS)."""
    return [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=1.0, seed=11, max_tokens=30),
        SamplingParams(temperature=1.0, seed=12, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=13, max_tokens=40, stop=["e"]),
        SamplingParams(temperature=1.0, seed=14, max_tokens=40, stop=[" t", "東"],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, seed=15, n=2, max_tokens=20),
        SamplingParams(temperature=1.0, seed=16, n=2, best_of=3, max_tokens=12),
        SamplingParams(temperature=0.8, seed=17, max_tokens=32, presence_penalty=0.5,
                       frequency_penalty=0.4, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=18, max_tokens=16, logprobs=2),
        SamplingParams(temperature=1.0, seed=19, max_tokens=36, min_tokens=8,
                       skip_special_tokens=False),
        SamplingParams(temperature=1.0, seed=20, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=["\ufffd", "é"]),
    ]


def tiny_path(folder: Path) -> str:
    make_tiny_model("llama", str(folder), seed=7)
    save_tiny_tokenizer(str(folder), "{{ messages }}")
    return str(folder)


def workload() -> list[tuple[str, SamplingParams]]:
    params = params_list()
    return [(TEXTS[i % len(TEXTS)] * (1 + i % 3), params[i % len(params)]) for i in range(30)]


def encode(out) -> dict[str, Any]:
    return {"id": out.request_id, "finished": out.finished, "error": out.error,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish": c.finish_reason, "stop": c.stop_reason,
                         "cum_logprob": c.cumulative_logprob,
                         "logprobs": None if c.logprobs is None else
                         [{str(k): [v.logprob, v.rank, v.decoded_token] for k, v in e.items()}
                          for e in c.logprobs]}
                        for c in out.outputs]}


def run_generate(path: str) -> list:
    llm = LLM(path, **ENGINE)
    prompts, params = zip(*workload())
    return [encode(o) for o in llm.generate(list(prompts), list(params), use_tqdm=False)]


def run_mixed(path: str) -> list:
    """LLMEngine.step by hand: final-only steps, full (non-delta) outputs at steps 9-11 and
    delta outputs at 15 and 21, aborts before steps 13 (full) and 14 (delta); every output
    any step returned, in order."""
    engine = LLM(path, **ENGINE).llm_engine
    for i, (prompt, params) in enumerate(workload()):
        engine.add_request(*engine.make_request(prompt, params, request_id=f"r{i}"))
    steps, step = [], 0
    while engine.has_unfinished_requests():
        if step == 13:
            steps.append([encode(o) for o in engine.abort_requests(["r10", "r5"])])
        if step == 14:
            steps.append([encode(o) for o in engine.abort_requests(["r2", "r1"], delta=True)])
        final_only = step not in (9, 10, 11, 15, 21)
        outs = engine.step(delta=step in (15, 21), final_only=final_only)
        steps.append([encode(o) for o in outs])
        step += 1
    return steps


def record_all(path: str) -> dict[str, Any]:
    return {"generate": run_generate(path), "mixed": run_mixed(path)}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        recorded = record_all(tiny_path(Path(folder)))
    GOLDEN.write_text(json.dumps(recorded, indent=0, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"recorded {sum(len(v) for v in recorded.values())} entries to {GOLDEN}")
