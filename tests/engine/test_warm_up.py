"""The start-up warm-up (ModelRunner.warm_up, TOKENWEIR_WARMUP): it runs when enabled (on CPU
one dummy request of min(budget, WARM_UP_CPU_TOKENS) tokens, then its decode with logits; on CUDA the whole
budget in requests of 256), it touches only scratch pool blocks (greedy outputs equal an engine
built without it), it is skipped when the pool is too small to hold it, and TOKENWEIR_WARMUP=0
turns it off."""

from __future__ import annotations

from tokenweir import LLM, SamplingParams
from tokenweir.engine.llm_engine import WARM_UP_CPU_TOKENS
from tokenweir.runner.model_runner import ModelRunner

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 31], [8, 8, 100], list(range(20, 60))]


def _greedy(path: str, device: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=path, dtype="float32", seed=0, device=device, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_warm_up_runs_and_changes_no_output(tiny_llama_path, device, monkeypatch):
    calls, forwards = [], []
    warm_up, forward = ModelRunner.warm_up, None

    def counting(self, num_tokens, num_seqs, chunk=256):
        nonlocal forward
        calls.append((num_tokens, num_seqs))
        forward = self.model.forward
        self.model.forward = lambda ids, *a, **k: (forwards.append(ids.numel()),
                                                   forward(ids, *a, **k))[1]
        try:
            return warm_up(self, num_tokens, num_seqs, chunk)
        finally:
            del self.model.forward  # back to the class's method
    monkeypatch.setattr(ModelRunner, "warm_up", counting)
    monkeypatch.setenv("TOKENWEIR_WARMUP", "0")
    cold = _greedy(tiny_llama_path, device, max_num_batched_tokens=1024, max_num_seqs=8)
    assert calls == []  # off: never called
    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")
    warm = _greedy(tiny_llama_path, device, max_num_batched_tokens=1024, max_num_seqs=8)
    if device == "cpu":  # one request of WARM_UP_CPU_TOKENS, not the 1024-token budget
        assert WARM_UP_CPU_TOKENS < 1024
        assert calls == [(WARM_UP_CPU_TOKENS, 1)]
        assert forwards == [WARM_UP_CPU_TOKENS, 1]  # probe: the prefill ran, then its decode
    else:
        assert calls == [(1024, 8)]
        assert forwards == [1024, 4]  # probe: 4 requests of 256 prefilled, then their 4 decodes
    assert warm == cold


def test_a_pool_too_small_skips_the_warm_up(tiny_llama_path, device, monkeypatch):
    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")
    ran, warm_up = [], ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up",
                        lambda self, *a: ran.append(warm_up(self, *a)) or ran[-1])
    # WARM_UP_CPU_TOKENS (CPU) or 2048 in requests of 256 (CUDA) need ceil((tokens + 1) / 16)
    # blocks of 16 per request (one slot more for the decode) from block 1 on: a pool of that
    # many blocks (block 0 is the null block) is one short; the engine still builds and serves
    # a 64-token context in it (at least 4 usable blocks)
    pool = max(5, -(-(WARM_UP_CPU_TOKENS + 1) // 16))
    out = _greedy(tiny_llama_path, device, max_num_batched_tokens=2048, max_model_len=64,
                  num_gpu_blocks_override=pool)
    assert ran == [False]  # probe: called, and it declined
    if device == "cpu" and pool == -(-(WARM_UP_CPU_TOKENS + 1) // 16):  # the boundary is exact:
        _greedy(tiny_llama_path, device, max_num_batched_tokens=2048, max_model_len=64,
                num_gpu_blocks_override=pool + 1)  # one block more and it runs
        assert ran == [False, True]
    assert all(len(tokens) == 12 for tokens in out)


def test_generate_skips_the_cpu_warm_up_with_the_same_tokens(tiny_llama_path, monkeypatch):
    """`tokenweir generate` builds its engine with cpu_warm_up=False (its one batch is the
    first request: a warm-up would only move the one-time costs before it): no warm-up even
    with TOKENWEIR_WARMUP=1, and the same token ids as an engine that warmed up."""
    from tokenweir.cli import main
    from tokenweir.engine.llm import LLM as EngineLLM

    monkeypatch.setenv("TOKENWEIR_WARMUP", "1")
    calls, outputs, run, warm_up = [], [], EngineLLM._run, ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up",
                        lambda self, *a: calls.append(a) or warm_up(self, *a))
    monkeypatch.setattr(EngineLLM, "_run", lambda self, *a: outputs.append(run(self, *a))
                        or outputs[-1])
    prompts = ["The river", "A cat sat on"]
    assert main(["generate", "--model", tiny_llama_path, "--dtype", "float32", "--no-chat",
                 "--max-tokens", "10", "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    assert calls == []  # the CLI's engine did not warm up
    warm = LLM(model=tiny_llama_path, dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert len(calls) == 1  # probe: an engine built the usual way did
    assert [list(o.outputs[0].token_ids) for o in outputs[0]] == \
        [list(o.outputs[0].token_ids) for o in warm]
