"""The scheduler reads the KV cache manager only through its public typed API.

Before the issue-13 split, scheduler.py read 21 members of the manager, among them its
bookkeeping (`registration_behind`), and blocks' ref counts (22 in all). The count below is the
script that measured that, kept as a test: every member the scheduler package (core/sched/**)
reads from the manager must be in its public API, and no block ref count is touched. A probe
shows the scan does see a read of an internal."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenweir.core.sched as sched_pkg

SCHED_DIR = Path(sched_pkg.__file__).parent

# The manager's API for the scheduler: methods, read-only properties, and the typed answers'
# fields (ComputedBlocks, PreemptionFootprint, SwapIn) reach the scheduler as plain values.
PUBLIC_API = {
    "allocate_slots", "block_ids", "block_size", "blocks_for_tokens", "check_integrity",
    "enable_prefix_caching", "free", "get_computed_blocks", "has_lagging_registrations",
    "is_swapped", "num_blocks_to_admit", "num_free_blocks", "num_held_blocks",
    "num_usable_blocks", "preemption_footprint", "readmit_swapped", "record_admission",
    "register_computed_blocks", "swap_out",
    # parallel sampling (issue 15): forks share blocks, their first write copies one
    "fork", "fresh_forks", "allocate_fork_slots",
}
INTERNALS = {"pool", "host_pool", "req_to_blocks", "req_to_host_blocks", "num_registered",
             "registration_behind", "prefix_stats"}


def kv_members_read(source: str) -> set[str]:
    """Attributes read off `kv`, `self.kv`, `sched.kv` or `self.sched.kv`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "kv") or \
                    (isinstance(v, ast.Name) and v.id in ("kv", "kv_cache_manager")):
                found.add(node.attr)
    return found


def block_ref_counts_read(source: str) -> int:
    return sum(1 for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Attribute) and node.attr == "ref_cnt")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(SCHED_DIR)): p.read_text() for p in SCHED_DIR.rglob("*.py")}


def test_scheduler_reads_only_the_managers_public_typed_api():
    read = set().union(*(kv_members_read(src) for src in _sources().values()))
    assert read <= PUBLIC_API, f"the scheduler reads manager members outside its API: " \
                               f"{sorted(read - PUBLIC_API)}"
    assert not read & INTERNALS
    assert {"allocate_slots", "get_computed_blocks", "preemption_footprint"} <= read  # probe
    # 22 before (21 manager members + block ref counts); parallel sampling added 3 members
    assert len(read) <= 22


def test_scheduler_touches_no_block_ref_counts():
    assert {name: n for name, src in _sources().items()
            if (n := block_ref_counts_read(src))} == {}


def test_the_scan_sees_an_internal_read():
    """Probe: the scan is not blind (the pre-split scheduler's reads, in miniature)."""
    old = ("def f(self, request):\n"
           "    behind = self.kv.registration_behind\n"
           "    kv = self.kv\n"
           "    return kv.num_shared_tokens(request), [b.ref_cnt for b in hits]\n")
    assert kv_members_read(old) == {"registration_behind", "num_shared_tokens"}
    assert block_ref_counts_read(old) == 1


def test_every_public_api_name_exists_on_the_manager():
    from tokenweir.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(8, 4)
    assert all(hasattr(kv, name) for name in PUBLIC_API)
    assert not any(name.startswith("_") for name in PUBLIC_API)
