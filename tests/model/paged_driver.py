"""Test-only driver: a minimal scheduler + runner around the paged forward.

Blocks are handed out sequentially from 1 (0 is the null block). Each `step` runs ONE flattened
forward over the scheduled (request, n_tokens) pairs, decodes first, exactly as the real runner
does, and returns the float32 logits of each request's last scheduled token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenweir.model.attention import allocate_kv_caches, build_attention_metadata


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(self, model, arch, *, block_size: int = 4, num_blocks: int = 512,
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 backend=None) -> None:
        """backend: an attention backend (tokenweir/model/backends); None: attention.py's."""
        self.model, self.block_size, self.device = model, block_size, device
        self.backend = backend
        self.kv_caches = allocate_kv_caches(arch, num_blocks, block_size, dtype, device)
        self.num_blocks = num_blocks
        self.next_block = 1
        self.seqs: dict[str, _Seq] = {}

    def add(self, rid: str, prompt: list[int]) -> None:
        self.seqs[rid] = _Seq(list(prompt))

    def append(self, rid: str, token: int) -> None:
        self.seqs[rid].tokens.append(token)

    def _reserve(self, seq: _Seq, n_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < n_tokens:
            assert self.next_block < self.num_blocks, "driver ran out of blocks"
            seq.blocks.append(self.next_block)
            self.next_block += 1

    @torch.inference_mode()
    def step(self, schedule: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Run the scheduled tokens; returns {rid: logits[vocab]} at each last scheduled token."""
        order = sorted(schedule, key=lambda x: x[1] != 1)  # decodes first, stable
        ids, pos, qlens, ctx, tables, last_rows = [], [], [], [], [], []
        for rid, n in order:
            seq = self.seqs[rid]
            start = seq.num_computed
            assert start + n <= len(seq.tokens), (rid, start, n, len(seq.tokens))
            self._reserve(seq, start + n)
            ids += seq.tokens[start:start + n]
            pos += range(start, start + n)
            qlens.append(n)
            ctx.append(start)
            tables.append(seq.blocks)
            last_rows.append(len(ids) - 1)
        meta = build_attention_metadata(qlens, ctx, tables, self.block_size, self.device,
                                        self.backend)
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(pos, device=self.device), meta, self.kv_caches)
        # a copy: compute_logits may return a view of a buffer its next call overwrites
        logits = self.model.compute_logits(
            hidden[torch.tensor(last_rows, device=self.device)]).clone()
        for rid, n in order:
            self.seqs[rid].num_computed += n
        return {rid: logits[i] for i, (rid, _) in enumerate(order)}


def run_greedy(driver: PagedDriver, prompts: dict[str, list[int]], max_new: int,
               chunk: int | None = None, stagger: bool = False
               ) -> tuple[dict[str, list[int]], list[tuple[str, int, torch.Tensor]]]:
    """Greedy-decode every prompt for `max_new` tokens through the driver.

    chunk=None: every prompt prefilled in one chunk (all in the first step). chunk=k: prompts
    are fed k tokens per step while requests that finished their prompt decode in the same
    flattened step; stagger=True starts request i at step i. Returns the generated tokens and,
    for every sampled position, (rid, sequence length so far, logits)."""
    for rid, p in prompts.items():
        driver.add(rid, p)
    out = {rid: [] for rid in prompts}
    records = []
    step_no = 0
    while any(len(v) < max_new for v in out.values()):
        schedule = []
        for i, rid in enumerate(prompts):
            if len(out[rid]) >= max_new or (stagger and i > step_no):
                continue
            seq = driver.seqs[rid]
            remaining = len(seq.tokens) - seq.num_computed
            schedule.append((rid, remaining if chunk is None else min(chunk, remaining)))
        results = driver.step(schedule)
        for rid, logits in results.items():
            seq = driver.seqs[rid]
            if seq.num_computed == len(seq.tokens):  # reached the end: sample
                records.append((rid, len(seq.tokens), logits))
                token = int(logits.argmax())
                out[rid].append(token)
                driver.append(rid, token)
        step_no += 1
    return out, records
