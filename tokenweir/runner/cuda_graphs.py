"""CUDA graphs for decode-only steps, one per batch-size bucket (as vLLM and nano-vllm do).

A decode step of a small model on a GPU costs its kernel launches, not its FLOPs: hundreds of
launches from Python per step. A captured graph replays them all in one call. Graphs need
fixed shapes and fixed addresses, so:

* the live batch of n decodes is padded to the smallest bucket >= n (`bucket_for`);
* every input lives in a static buffer (`StaticDecodeBuffers`): token ids, positions, slot
  mapping, sequence lengths, query start offsets, block tables and the attention backend's tile
  table. Each step writes its rows into them (one pinned, non-blocking host-to-device copy);
  padding rows are 1-token "decodes" of context 1 that read and write slot 0 of the null block
  (block 0 is never handed to a request; its content is garbage by contract), so they cost one
  row each and change nothing live;
* the attention backend's per-step plan is preset from the static buffers (the Triton backend's
  decode tile table is arange(bucket)), so nothing is derived from host lists inside the graph.

Graphs are captured lazily, one bucket at a time, at the first step that needs it, and replayed
after. Only CUDA captures; the padding and static-buffer logic runs anywhere (the CPU tests run
the padded forward eagerly and compare it with the unpadded one).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from tokenweir.model.attention import AttentionMetadata
from tokenweir.model.layers import batch_invariant
from tokenweir.model.transfer import host_long

logger = logging.getLogger("tokenweir")

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224,
                                    256, 320, 384, 448, 512)


def bucket_for(n: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket holding n rows, None when n exceeds the largest (eager step)."""
    for bucket in buckets:
        if bucket >= n:
            return bucket
    return None


class StaticDecodeBuffers:
    """Fixed-address inputs of decode steps of up to `max_batch` requests (see module doc)."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device, group: int = 1) -> None:
        """group: query heads per KV head (the Triton plan's rows per token)."""
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device, self.group = device, group
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slot_mapping = torch.zeros(max_batch, **long)
        self.seq_lens = torch.ones(max_batch, **long)
        self.query_start_loc = torch.arange(max_batch + 1, **long)  # one query row each
        self.block_tables = torch.zeros(max_batch, max_blocks, **long)
        self.tile_seq = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.tile_start = torch.zeros(max_batch, dtype=torch.int32, device=device)

    def fill(self, input_ids: Sequence[int], positions: Sequence[int],
             block_tables: Sequence[Sequence[int]], bucket: int) -> list[int]:
        """Write n live decode rows, padded to `bucket` (n may be 0: padding only, as a
        capture at start-up does). Returns the live rows' sequence lengths after the step
        (positions + 1). Only the first `width` columns of the block tables are written
        (width: the longest live table): the kernel reads no entry past a row's own blocks,
        and a padding row reads only its first entry (0, the null block)."""
        n = len(input_ids)
        if not 0 <= n <= bucket <= self.max_batch:
            raise ValueError(f"{n} rows do not fit bucket {bucket} (max {self.max_batch})")
        bs = self.block_size
        pad = bucket - n
        width = max(map(len, block_tables), default=1) or 1
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds {self.max_blocks}")
        seq_lens = [p + 1 for p in positions]
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions)]
        flat: list[int] = []
        for blocks in block_tables:
            flat.extend(blocks)
            flat.extend([0] * (width - len(blocks)))
        flat.extend([0] * (pad * width))
        rows = host_long([*input_ids, *[0] * pad, *positions, *[0] * pad, *slots, *[0] * pad,
                          *seq_lens, *[1] * pad, *flat])
        cuda = self.device.type == "cuda"
        if cuda:
            rows = rows.pin_memory()
        for i, dst in enumerate((self.input_ids, self.positions, self.slot_mapping,
                                 self.seq_lens)):
            dst[:bucket].copy_(rows[i * bucket:(i + 1) * bucket], non_blocking=cuda)
        self.block_tables[:bucket, :width].copy_(rows[4 * bucket:].view(bucket, width),
                                                 non_blocking=cuda)
        return seq_lens

    def metadata(self, bucket: int, seq_lens_cpu: list[int], backend,
                 invariant: bool = False) -> AttentionMetadata:
        """The bucket's metadata over the static buffers. `seq_lens_cpu`: the live rows' (the
        padding rows' are 1); only eager paths read the host lists, a graph never does.
        `invariant` (batch-invariant mode): the prefill tile shape, as triton_paged.plan_step
        gives every step in that mode."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:bucket],
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=list(seq_lens_cpu) + [1] * (bucket - len(seq_lens_cpu)),
            num_decodes=bucket, backend=backend, batch_invariant=invariant)
        if getattr(backend, "name", None) == "triton":
            from tokenweir.model.backends.triton_paged import TritonPlan, launch_sizes
            meta.backend_plan = TritonPlan(self.tile_seq[:bucket], self.tile_start[:bucket],
                                           *launch_sizes(self.group, decode_only=not invariant))
        return meta


class DecodeGraphs:
    """Captures and replays one CUDA graph per bucket of decode-only steps."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend,
                 block_size: int, max_blocks: int, group: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = tuple(sorted(buckets))
        self.buffers = StaticDecodeBuffers(self.buckets[-1], max_blocks, block_size,
                                           kv_caches[0].device, group)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0

    def run(self, input_ids: Sequence[int], positions: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> Optional[torch.Tensor]:
        """Hidden states [n, hidden] of a decode-only step, or None (no bucket holds it or a
        table is too wide: run it eagerly). The result is a view of the graph's output: use it
        before the next replay."""
        bucket = bucket_for(len(input_ids), self.buckets)
        if bucket is None or max(map(len, block_tables)) > self.buffers.max_blocks:
            return None
        seq_lens = self.buffers.fill(input_ids, positions, block_tables, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, seq_lens)
        graph, hidden = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return hidden[:len(input_ids)]

    def capture_all(self, max_batch: int) -> int:
        """Capture the graph of every bucket a batch of up to `max_batch` decodes can use, now
        (start-up) rather than at the first step of each size: a capture costs a forward and
        any compilation of the kernels' variants, which would otherwise land inside serving.
        The captures attend padding rows only (the null block). Returns how many it took."""
        largest = bucket_for(max_batch, self.buckets) or self.buckets[-1]
        taken = 0
        for bucket in self.buckets:
            if bucket > largest or bucket in self.graphs:
                continue
            self.buffers.fill([], [], [], bucket)
            self.graphs[bucket] = self._capture(bucket, [])
            taken += 1
        return taken

    def _capture(self, bucket: int, seq_lens: list[int]) -> tuple:
        b = self.buffers
        meta = b.metadata(bucket, seq_lens, self.backend, invariant=batch_invariant(self.model))

        def forward() -> torch.Tensor:
            return self.model(b.input_ids[:bucket], b.positions[:bucket], meta, self.kv_caches)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy inits, autotuning)
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward()
        self.pool = graph.pool()
        logger.info("captured a CUDA graph for decode steps of %d rows", bucket)
        return graph, hidden
