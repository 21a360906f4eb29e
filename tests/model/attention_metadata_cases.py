"""Random steps for build_attention_metadata, and a digest of everything it returns: the
recorded digests (attention_metadata_digests.json, recorded on main 495a511 before the decode
fast path) prove a rewrite of it changed nothing. `python tests/model/attention_metadata_cases.py`
re-records them."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from tokenweir.model.attention import build_attention_metadata

DIGESTS = Path(__file__).with_name("attention_metadata_digests.json")


def cases(count: int = 60):
    """(query_lens, context_lens, block tables, block size): decodes first, then prefill
    chunks; some steps all decodes, some all prefills, tables longer than needed at times."""
    rng = random.Random(33)
    for k in range(count):
        block_size = rng.choice([1, 8, 16])
        decodes = rng.choice([0, 1, 5, 64]) if k % 4 else rng.randrange(1, 300)
        prefills = 0 if k % 3 == 0 else rng.randrange(0, 4)
        query = [1] * decodes + [rng.randrange(1, 90) for _ in range(prefills)]
        if not query:
            query = [1]
        context = [rng.randrange(0, 200) for _ in query]
        tables = []
        for q, c in zip(query, context):
            need = -(-(q + c) // block_size)
            tables.append([rng.randrange(1, 5000) for _ in range(need + rng.choice([0, 0, 2]))])
        yield query, context, tables, block_size


def digest(meta) -> str:
    h = hashlib.sha256()
    for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping):
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().numpy().tobytes())
    h.update(repr((meta.query_lens_cpu, meta.seq_lens_cpu, meta.num_decodes)).encode())
    return h.hexdigest()


def all_digests() -> list[str]:
    return [digest(build_attention_metadata(q, c, t, bs, torch.device("cpu")))
            for q, c, t, bs in cases()]


if __name__ == "__main__":
    DIGESTS.write_text(json.dumps(all_digests(), indent=0) + "\n")
    print(f"recorded {DIGESTS}")
