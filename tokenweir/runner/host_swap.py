"""Block copies between the device KV pool and the host (swap) pool.

On CUDA the host pool is pinned and neither direction blocks the host inside a step:

* swap-in (host -> device): the blocks of every layer are gathered on the host into ONE pinned
  staging tensor, copied with `non_blocking`, and scattered on the device, stream-ordered
  before the step's forward;
* swap-out (device -> host): gathered on the device, copied with `non_blocking` into pinned
  staging, and an event recorded; the host-side scatter into the pool happens in `finish()`,
  which the runner calls after reading the step's sampled tokens (the copy has run by then),
  and which every later swap-in calls first (host blocks are read only after they landed).

The caching host allocator keeps a pinned staging tensor alive until the copies that use it
have run. On CPU (or with `staged=False`) both directions are plain synchronous copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def copy_blocks(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (K and V, every layer): dst[:, d] = src[:, s] for each (s, d).
    Synchronous across devices."""
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_layers[0].device)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_layers[0].device)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(1, dst_ids, src.index_select(1, src_ids).to(dst.device))


@dataclass
class _PendingOut:
    staging: torch.Tensor  # [layers, 2, n, block_size, kv_heads, head_dim] on the host
    host_ids: torch.Tensor
    event: Optional[torch.cuda.Event]


class HostSwapper:
    """See the module docstring. `staged` defaults to whether the device is CUDA."""

    def __init__(self, device_layers: list[torch.Tensor], host_layers: list[torch.Tensor],
                 staged: Optional[bool] = None) -> None:
        self.device_layers, self.host_layers = device_layers, host_layers
        self.device = device_layers[0].device if device_layers else torch.device("cpu")
        self.staged = self.device.type == "cuda" if staged is None else staged
        self.pin = self.device.type == "cuda"
        self._pending: list[_PendingOut] = []

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        self.finish()
        if not self.staged:
            copy_blocks(self.host_layers, self.device_layers, pairs)
            return
        host_ids = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        staging = self._staging(len(pairs))
        for layer, host in enumerate(self.host_layers):
            torch.index_select(host, 1, host_ids, out=staging[layer])
        on_device = staging.to(self.device, non_blocking=True)
        (device_ids,) = _ids([d for _, d in pairs], self.device)
        for layer, dst in enumerate(self.device_layers):
            dst.index_copy_(1, device_ids, on_device[layer])

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs; they land on the host by `finish()`."""
        if not self.staged:
            copy_blocks(self.device_layers, self.host_layers, pairs)
            return
        (device_ids,) = _ids([d for d, _ in pairs], self.device)
        gathered = torch.stack([layer.index_select(1, device_ids)
                                for layer in self.device_layers])
        staging = self._staging(len(pairs))
        staging.copy_(gathered, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        host_ids = torch.tensor([h for _, h in pairs], dtype=torch.long)
        self._pending.append(_PendingOut(staging, host_ids, event))

    def finish(self) -> None:
        """Land every pending swap-out in the host pool (waits for its copy if still running)."""
        for pending in self._pending:
            if pending.event is not None:
                pending.event.synchronize()
            for layer, host in enumerate(self.host_layers):
                host.index_copy_(1, pending.host_ids, pending.staging[layer])
        self._pending.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        shape = (len(self.host_layers), 2, num_blocks, *self.host_layers[0].shape[2:])
        return torch.empty(shape, dtype=self.host_layers[0].dtype, pin_memory=self.pin)


def _ids(values: list[int], device: torch.device) -> tuple[torch.Tensor]:
    ids = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return (ids.to(device, non_blocking=True),)
