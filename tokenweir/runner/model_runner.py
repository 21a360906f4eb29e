"""The real runner: turns a SchedulerOutput into one flattened forward pass and sampled tokens.

It keeps its own copy of each scheduled request (token ids, block table, computed count),
updated from the scheduler's diffs. Every step runs ONE unpadded forward over all scheduled
tokens, decodes first (the attention op batches them), then prefill chunks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tokenweir import faults
from tokenweir.core.outputs import CutReport, ModelRunnerOutput, SchedulerOutput
from tokenweir.core.sched.policy import PreemptionCosts
from tokenweir.guided.masks import GuidedRow
from tokenweir.model import kernels
from tokenweir.model.attention import (allocate_kv_caches, build_attention_metadata,
                                       to_device_long)
from tokenweir.model.backends import select_backend
from tokenweir.model.layers import batch_invariant
from tokenweir.model.penalties import TokenHistory
from tokenweir.model.sampler import sample_isolated
from tokenweir.request import SamplingParams
from tokenweir.runner.host_swap import HostSwapper, copy_blocks  # noqa: F401 (re-exported)
from tokenweir.runner.interrupt import CutSignal, StepCut, make_layer_hook


logger = logging.getLogger("tokenweir")


@dataclass(slots=True)
class _RunnerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    # token_ids again as an int64 buffer, only for requests with penalties (the sampler
    # reads it each step; a list would be converted every time).
    history: Optional[TokenHistory] = None


@dataclass(slots=True)
class _Batch:
    """Flattened inputs of one step, request order = attention order."""

    req_ids: list[str]
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]  # tokens already cached before this step
    sample_req_ids: list[str]  # requests whose step reaches the end of their known tokens
    sample_rows: list[int]  # flat index of each one's last token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, eos_token_ids: frozenset[int],
                 seed: int = 0, num_host_blocks: int = 0) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.kv_caches = allocate_kv_caches(arch, num_blocks, block_size, dtype, device)
        # Runs every step's attention (tokenweir/model/backends); None: attention.py's own path.
        self.attention_backend = select_backend(device)
        if device.type == "cpu":
            kernels.paged_attention_kernel()  # build (or load) the C++ kernels now, not mid-step
        # The swap pool lives in host memory (pinned when the pool is on CUDA: asynchronous
        # copies); on a CPU-only machine it is a second CPU pool.
        self.host_caches = (allocate_kv_caches(arch, num_host_blocks, block_size, dtype,
                                               torch.device("cpu"),
                                               pin_memory=device.type == "cuda")
                            if num_host_blocks else [])
        self.swapper = HostSwapper(self.kv_caches, self.host_caches)
        # Decode-only steps replay a CUDA graph per batch bucket (runner/cuda_graphs.py): on
        # CUDA with the Triton backend, unless TOKENWEIR_CUDA_GRAPHS=0. Any capture failure
        # turns them off (logged) and the step runs eagerly.
        self.graphs = self._decode_graphs(arch, num_blocks)
        self.requests: dict[str, _RunnerRequest] = {}
        # Set by the engine under the slo policy: the monitor's orders to cut a step.
        self.cut_signal: Optional[CutSignal] = None
        # Request id -> why its sampling failed, for the step being executed.
        self.sample_errors: dict[str, str] = {}
        # Set by the engine when the model has a tokenizer: the grammar matchers of guided
        # requests (tokenweir/guided/decoder.py). None: guided requests are not served.
        self.guided = None
        self.guided_ids: set[str] = set()  # the requests in `requests` with a grammar

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A cut step (see runner/interrupt.py) returns `cut` set and samples nothing; the
        per-request copies then stand exactly as before the forward (state updates taken in,
        nothing advanced), which is what the scheduler's rollback assumes."""
        start = time.perf_counter()
        self._update_states(out)
        self._swap(out)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self._make_batch(out)
        self._start_guided_masks(batch)  # computed on a worker thread during the forward
        hook = make_layer_hook(self.cut_signal, out.step_id) if self.cut_signal else None
        if faults.ARMED:
            for req_id in batch.req_ids:
                faults.fire("forward", req_id)
        prepared = time.perf_counter()
        try:
            hidden = self._forward(batch, hook)
        except StepCut as cut:
            report = CutReport(out.step_id, cut.layer_index, len(self.kv_caches),
                               cut.order.victim_id, cut.order.waiter_id)
            end = time.perf_counter()
            return ModelRunnerOutput(sampled_token_ids={}, cut=report, step_seconds=end - start,
                                     phase_seconds={"prepare": prepared - start,
                                                    "forward": end - prepared})
        forwarded = time.perf_counter()
        self.sample_errors = {}
        sampled, logprobs = self._sample(batch, hidden, out.step_id)
        self.swapper.finish()  # the sampled tokens were read: this step's copies have run
        self._advance_guided(sampled)
        for req_id in self.sample_errors:  # a request whose sampling failed gets no token
            sampled.pop(req_id, None)
        self._advance(batch, out, sampled)
        end = time.perf_counter()
        return ModelRunnerOutput(sampled_token_ids={r: [t] for r, t in sampled.items()},
                                 logprobs=logprobs, step_seconds=end - start,
                                 request_errors=self.sample_errors,
                                 phase_seconds={"prepare": prepared - start,
                                                "forward": forwarded - prepared,
                                                "sample": end - forwarded})

    # ---- measured rates ---------------------------------------------------------------
    @torch.inference_mode()
    def measure_preemption_costs(self, num_tokens: int = 256, repeats: int = 2) -> PreemptionCosts:
        """Time a prefill (seconds per token) and block copies to and from the host pool
        (seconds per block, one direction). Call before serving: it writes scratch K/V into
        the first blocks of the (still empty) pool. The probe never reaches past the pool:
        it prefills at most as many tokens as the usable blocks hold, and copies at most as
        many blocks as the host pool has."""
        num_tokens = min(num_tokens, (self.kv_caches[0].shape[1] - 1) * self.block_size)
        num_blocks = -(-num_tokens // self.block_size)
        block_ids = list(range(1, num_blocks + 1))
        positions = torch.arange(num_tokens, device=self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)

        def prefill() -> None:
            attn = build_attention_metadata([num_tokens], [0], [block_ids], self.block_size,
                                            self.device, self.attention_backend,
                                            batch_invariant=batch_invariant(self.model))
            self.model(input_ids, positions, attn, self.kv_caches)

        per_token = self._best_time(prefill, repeats) / num_tokens
        host = self.host_caches or self.kv_caches  # no host pool: swap is never chosen anyway
        pairs = [(b, i) for i, b in enumerate(block_ids[:host[0].shape[1]])]
        back = [(h, d) for d, h in pairs]

        def round_trip() -> None:
            copy_blocks(self.kv_caches, host, pairs)
            copy_blocks(host, self.kv_caches, back)

        per_block = self._best_time(round_trip, repeats) / (2 * len(pairs))
        return PreemptionCosts(prefill_seconds_per_token=per_token,
                               swap_seconds_per_block=per_block)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_seqs: int, chunk: int = 256) -> bool:
        """Run one dummy step of `num_tokens` prefill tokens (requests of `chunk` tokens) and
        one of their decodes with their logits, as vLLM's start-up profile run does, so that
        the first real step does not pay for first-touch memory, the oneDNN primitives of the
        largest row bucket and lazily packed weights. Call before serving: it writes scratch
        K/V into the pool (as measure_ttft_line does). Returns whether it ran."""
        num_tokens = min(num_tokens, (self.kv_caches[0].shape[1] - 1) * self.block_size)
        lens = [min(chunk, num_tokens - start) for start in range(0, num_tokens, chunk)]
        lens = lens[:max(1, num_seqs)]
        if not lens:
            return False
        tables, next_block = [], 1
        for n in lens:  # one more slot per request: the decode step writes it
            need = -(-(n + 1) // self.block_size)
            tables.append(list(range(next_block, next_block + need)))
            next_block += need
        if next_block > self.kv_caches[0].shape[1]:
            return False  # a pool too small to warm up in: the first step pays, as before
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        attn = build_attention_metadata(lens, [0] * len(lens), tables, self.block_size,
                                        self.device, self.attention_backend,
                                        batch_invariant=batch_invariant(self.model))
        ids = torch.zeros(sum(lens), dtype=torch.long, device=self.device)
        self.model(ids, positions, attn, self.kv_caches)
        attn = build_attention_metadata([1] * len(lens), lens, tables, self.block_size,
                                        self.device, self.attention_backend,
                                        batch_invariant=batch_invariant(self.model))
        ids = torch.zeros(len(lens), dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.tensor(lens, device=self.device), attn, self.kv_caches)
        self.model.compute_logits(hidden)
        return True

    @torch.inference_mode()
    def measure_ttft_line(self, short: int = 128, long: int = 1024,
                          repeats: int = 2) -> tuple[float, float]:
        """Fit ttft = a * tokens + c (seconds) through two timed solo prefills, logits of the
        last token included. Call before serving: it writes scratch K/V into the pool."""
        long = min(long, (self.kv_caches[0].shape[1] - 1) * self.block_size)
        short = min(short, long // 2)

        def prefill(n: int) -> None:
            block_ids = list(range(1, -(-n // self.block_size) + 1))
            attn = build_attention_metadata([n], [0], [block_ids], self.block_size, self.device,
                                            self.attention_backend,
                                            batch_invariant=batch_invariant(self.model))
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(n, device=self.device), attn, self.kv_caches)
            self.model.compute_logits(hidden[-1:])

        t_short = self._best_time(lambda: prefill(short), repeats)
        t_long = self._best_time(lambda: prefill(long), repeats)
        a = max(0.0, (t_long - t_short) / (long - short))
        return a, max(0.0, t_short - a * short)

    def _best_time(self, fn, repeats: int) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    # ---- state ------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.guided_ids.discard(req_id)
        if self.guided is not None:
            self.guided.forget(out.finished_req_ids | out.preempted_req_ids)
        for new in out.scheduled_new_reqs:
            if new.sampling_params.guided_decoding is not None:
                self.guided_ids.add(new.req_id)
            self.requests[new.req_id] = _RunnerRequest(
                token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                params=new.sampling_params,
                history=TokenHistory(new.token_ids) if new.sampling_params.uses_penalties
                else None)
        self._update_cached(out)

    def _update_cached(self, out: SchedulerOutput) -> None:
        """The running requests' diffs: new blocks appended (only requests that got some are
        visited), computed counts checked against the scheduler's in one list comparison."""
        requests = self.requests
        new_ids = {new.req_id for new in out.scheduled_new_reqs}
        for req_id, block_ids in out.new_block_ids.items():
            if block_ids and req_id not in new_ids:
                requests[req_id].block_ids.extend(block_ids)
        ids, computed = out.cached_req_ids, out.cached_num_computed_tokens
        if [requests[r].num_computed_tokens for r in ids] != computed:
            req_id, theirs = next((r, c) for r, c in zip(ids, computed)
                                  if requests[r].num_computed_tokens != c)
            raise AssertionError(f"{req_id}: runner has {requests[req_id].num_computed_tokens}"
                                 f" computed tokens, scheduler says {theirs}")

    def _swap(self, out: SchedulerOutput) -> None:
        """Block copies before the forward (see SchedulerOutput): copy-on-write sources read,
        swap-ins, swap-outs, then copy-on-write destinations written."""
        copies = out.blocks_to_copy
        pending = gather_blocks(self.kv_caches, [s for s, _ in copies]) if copies else None
        if out.blocks_to_swap_in:
            self.swapper.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_swap_out:
            self.swapper.swap_out(out.blocks_to_swap_out)  # lands on the host by finish()
        if pending is not None:
            scatter_blocks(self.kv_caches, [d for _, d in copies], pending)

    def _advance(self, batch: _Batch, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        requests = self.requests
        for req_id, n in zip(batch.req_ids, batch.query_lens):
            requests[req_id].num_computed_tokens += n
        for req_id, token_id in sampled.items():
            state = requests[req_id]
            state.token_ids.append(token_id)
            if state.history is not None:
                state.history.append(token_id)

    # ---- guided decoding (tokenweir/guided) --------------------------------------------
    def _start_guided_masks(self, batch: _Batch) -> None:
        """Start the masks of this step's guided rows (sampled rows, in sampling order)."""
        if self.guided is None:
            return
        if not self.guided_ids:
            self.guided.start_masks([])  # drops a job left over from a step that never sampled
            return
        rows = []
        for row, req_id in enumerate(batch.sample_req_ids):
            state = self.requests[req_id]
            if state.params.guided_decoding is not None:
                rows.append(GuidedRow(row, req_id, state.params.guided_decoding,
                                      state.token_ids[state.num_prompt_tokens:]))
        self.guided.start_masks(rows)

    def _advance_guided(self, sampled: dict[str, int]) -> None:
        """Each guided request's matcher consumes its sampled token; a refusal fails it."""
        if self.guided is None or not self.guided_ids:
            return
        for req_id, token_id in sampled.items():
            if req_id not in self.sample_errors and self.guided.is_guided(req_id):
                error = self.guided.advance(req_id, token_id)
                if error is not None:
                    self.sample_errors[req_id] = error

    # ---- inputs -----------------------------------------------------------------------
    def _make_batch(self, out: SchedulerOutput) -> _Batch:
        counts = out.num_scheduled_tokens
        if out.total_num_scheduled_tokens == len(counts):
            return self._make_decode_batch(list(counts))
        req_ids = sorted(counts, key=lambda r: counts[r] != 1)  # decodes first, stable
        batch = _Batch(req_ids, [], [], [], [], [], [])
        for req_id in req_ids:
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, counts[req_id]
            end = start + n
            batch.input_ids.extend(state.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.query_lens.append(n)
            batch.context_lens.append(start)
            if end >= len(state.token_ids):
                batch.sample_req_ids.append(req_id)
                batch.sample_rows.append(len(batch.input_ids) - 1)
        return batch

    def _make_decode_batch(self, req_ids: list[str]) -> _Batch:
        """_make_batch of a step where every request has one token (decodes, or one-token
        prefill chunks): flat list operations, no slice or range per request."""
        states = list(map(self.requests.__getitem__, req_ids))
        positions = [state.num_computed_tokens for state in states]
        input_ids = [state.token_ids[p] for state, p in zip(states, positions)]
        rows = [i for i, state in enumerate(states)
                if len(state.token_ids) <= state.num_computed_tokens + 1]
        sample_req_ids = list(req_ids) if len(rows) == len(req_ids) else [req_ids[i] for i in rows]
        return _Batch(req_ids, input_ids, positions, [1] * len(req_ids), list(positions),
                      sample_req_ids, rows)

    def _decode_graphs(self, arch, num_blocks: int):
        if (self.device.type != "cuda" or getattr(self.attention_backend, "name", None) != "triton"
                or os.environ.get("TOKENWEIR_CUDA_GRAPHS", "1") == "0"):
            return None
        from tokenweir.runner.cuda_graphs import DecodeGraphs
        max_blocks = -(-arch.max_position_embeddings // self.block_size)
        return DecodeGraphs(self.model, self.kv_caches, self.attention_backend, self.block_size,
                            min(max_blocks, num_blocks), arch.num_heads // arch.num_kv_heads)

    def capture_decode_graphs(self, max_batch: int) -> int:
        """CUDA: capture every decode bucket's graph up to `max_batch` rows now, before serving
        (runner/cuda_graphs.py capture_all). A failure turns graphs off (logged): decode steps
        then run eagerly, as with TOKENWEIR_CUDA_GRAPHS=0. Returns the number captured."""
        if self.graphs is None:
            return 0
        try:
            return self.graphs.capture_all(max_batch)
        except Exception:  # noqa: BLE001 (eager decode steps are slower, never wrong)
            logger.exception("CUDA graph capture failed: decode steps run eagerly")
            self.graphs = None
            return 0

    def _replay_decode_graph(self, batch: _Batch, block_tables: list[list[int]],
                             layer_hook) -> Optional[torch.Tensor]:
        """The hidden states of a decode-only step from its bucket's CUDA graph; None when
        the step does not qualify (prefill rows, a cut hook, no bucket) or graphs are off."""
        if (self.graphs is None or layer_hook is not None
                or len(batch.input_ids) != len(batch.req_ids)):
            return None
        try:
            return self.graphs.run(batch.input_ids, batch.positions, block_tables)
        except Exception:  # noqa: BLE001 (a capture that fails: eager from now on)
            logger.exception("CUDA graph capture failed: decode steps run eagerly")
            self.graphs = None
            return None

    def _forward(self, batch: _Batch, layer_hook=None) -> torch.Tensor:
        block_tables = [self.requests[r].block_ids for r in batch.req_ids]
        hidden = self._replay_decode_graph(batch, block_tables, layer_hook)
        if hidden is not None:
            return hidden
        attn = build_attention_metadata(batch.query_lens, batch.context_lens, block_tables,
                                        self.block_size, self.device, self.attention_backend,
                                        batch_invariant=batch_invariant(self.model))
        input_ids, positions = to_device_long([batch.input_ids, batch.positions], self.device)
        return self.model(input_ids, positions, attn, self.kv_caches, layer_hook=layer_hook)

    def _sample(self, batch: _Batch, hidden: torch.Tensor, step_id: int):
        if not batch.sample_req_ids:
            return {}, {}
        (rows,) = to_device_long([batch.sample_rows], hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        states = [self.requests[r] for r in batch.sample_req_ids]
        guided = self.guided.take_masks() if self.guided is not None else None
        result, errors = sample_isolated(
            logits, [s.params for s in states],
            [len(s.token_ids) - s.num_prompt_tokens for s in states],
            self.eos_token_ids, self.seed, step_id, batch.sample_req_ids,
            token_ids=[s.history.view() if s.history is not None else s.token_ids
                       for s in states],  # read only for rows with penalties
            guided=guided)
        # Rows that failed alone keep a placeholder token here (every rank must return one
        # per row); execute() drops them and reports the errors.
        self.sample_errors = {batch.sample_req_ids[i]: message for i, message in errors.items()}
        if guided is not None:
            self.sample_errors.update(guided.errors)
        sampled = dict(zip(batch.sample_req_ids, result.token_ids))
        logprobs = {r: lp for r, lp in zip(batch.sample_req_ids, result.logprobs)
                    if lp is not None}
        return sampled, logprobs


def gather_blocks(layers: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """A copy of these blocks (K and V) of every layer, in order."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    return [layer.index_select(1, ids) for layer in layers]


def scatter_blocks(layers: list[torch.Tensor], block_ids: list[int],
                   blocks: list[torch.Tensor]) -> None:
    """Write `blocks` (from gather_blocks) into these block ids of every layer."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for layer, content in zip(layers, blocks):
        layer.index_copy_(1, ids, content)
