"""Prefill/decode disaggregation: KV hand-offs from prefill instances to decode instances.

A request runs on a prefill instance with max_tokens=1; when it finishes, its prompt's cached
full blocks are pinned there (`Instance.hold_prefix`), a decode instance reserves blocks for
them, and the bytes cross that decode instance's link: `new blocks * block_size * KV bytes per
token / link bytes per second`. Transfers into one instance queue FIFO on its link, and a
transfer waits (FIFO) until the decode pool has room. The event loop (simulator.py) owns the
clock: `start_transfers` returns the transfers it started, each with its `done` time, and the
loop calls `finish` at that time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from tokenweir.request import Request
from tokenweir.sim.instance import Instance, KVImport

if TYPE_CHECKING:
    from tokenweir.sim.simulator import Job


@dataclass(slots=True)
class Handoff:
    job: Job
    prefill: Instance
    hold: Request  # pins the prompt's blocks on the prefill instance until `done`
    decode: Instance
    ready: float  # the prefill finished
    imp: Optional[KVImport] = None
    num_bytes: int = 0
    start: float = 0.0  # the bytes started to cross the link
    done: float = 0.0  # they have all arrived


@dataclass(slots=True)
class TransferRecord:
    request_id: str
    prefill: int
    decode: int
    num_bytes: int
    ready: float
    start: float
    done: float


class KVLinks:
    """The queue and the link into each decode instance, and the record of every transfer."""

    def __init__(self, decode: list[Instance], link_bytes_per_s: float,
                 kv_bytes_per_token: int) -> None:
        self.link_bytes_per_s = link_bytes_per_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.pending: dict[int, deque[Handoff]] = {d.index: deque() for d in decode}
        self._link_free: dict[int, float] = {d.index: 0.0 for d in decode}
        self.transfers: list[TransferRecord] = []

    def queued(self, decode: Instance) -> int:
        return len(self.pending[decode.index])

    def enqueue(self, handoff: Handoff) -> None:
        self.pending[handoff.decode.index].append(handoff)

    def start_transfers(self, decode: Instance, now: float) -> list[Handoff]:
        """Start queued transfers into `decode`, in order, while its pool has room."""
        queue, started = self.pending[decode.index], []
        while queue:
            h = queue[0]
            imp = decode.reserve_import(h.job.request_id, h.job.tokens, h.job.output_len)
            if imp is None:
                break
            queue.popleft()
            h.imp = imp
            h.num_bytes = imp.num_new_blocks * decode.kv.block_size * self.kv_bytes_per_token
            h.start = max(now, self._link_free[decode.index])
            h.done = h.start + h.num_bytes / self.link_bytes_per_s
            self._link_free[decode.index] = h.done
            started.append(h)
        return started

    def finish(self, h: Handoff, now: float) -> None:
        """The bytes have arrived: publish them on the decode instance, unpin the prefill's."""
        h.decode.complete_import(h.imp)
        h.prefill.release(h.hold)
        self.transfers.append(TransferRecord(h.job.request_id, h.prefill.index, h.decode.index,
                                             h.num_bytes, h.ready, h.start, now))

    def check_drained(self, now: float) -> None:
        for index, queue in self.pending.items():
            if queue:
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s: {len(queue)} KV transfers to decode "
                    f"instance {index} never found room in its pool")
