"""HostSwapper (runner/host_swap.py): staged block copies equal plain copies, swap-outs land on
the host only at finish(), and a swap-in first lands what is pending. On CUDA: the host pool
and staging are pinned and copies run with non_blocking."""

from __future__ import annotations

import pytest
import torch

from tokenweir.runner.host_swap import HostSwapper, copy_blocks

SHAPE = (2, 9, 4, 2, 8)  # [2, blocks, block_size, kv_heads, head_dim]


def _pools(device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pin = device == "cuda"
    dev = [torch.randn(SHAPE, generator=gen).to(device) for _ in range(3)]
    host = [torch.randn(SHAPE, generator=gen).pin_memory() if pin else
            torch.randn(SHAPE, generator=gen) for _ in range(3)]
    return dev, host


def test_staged_copies_equal_plain_copies(device):
    dev, host = _pools(device)
    want_dev, want_host = [t.clone() for t in dev], [t.clone() for t in host]
    swapper = HostSwapper(dev, host, staged=True)
    out_pairs, in_pairs = [(1, 5), (3, 2), (8, 0)], [(4, 6), (7, 1)]
    copy_blocks(want_dev, want_host, out_pairs)
    swapper.swap_out(out_pairs)
    assert swapper.has_pending  # probe: not landed yet ...
    assert not torch.equal(host[0][:, 5], want_host[0][:, 5])
    copy_blocks(want_host, want_dev, in_pairs)
    swapper.swap_in(in_pairs)  # ... a swap-in lands it first
    assert not swapper.has_pending
    for got, want in zip(dev + host, want_dev + want_host):
        assert torch.equal(got.cpu(), want.cpu())


def test_a_swap_in_reads_what_a_pending_swap_out_wrote(device):
    dev, host = _pools(device, seed=1)
    swapper = HostSwapper(dev, host, staged=True)
    block = dev[1][:, 2].clone()
    swapper.swap_out([(2, 3)])
    swapper.swap_in([(3, 6)])  # host block 3 only holds device block 2 once the swap-out landed
    assert torch.equal(dev[1][:, 6], block)


@pytest.mark.cuda
def test_cuda_swaps_are_pinned_and_asynchronous(monkeypatch):
    dev, host = _pools("cuda", seed=2)
    swapper = HostSwapper(dev, host)
    assert swapper.staged and all(h.is_pinned() for h in host)
    copies = []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def to(self, *args, **kwargs):
        copies.append(("to", self.device.type, self.is_pinned(), kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    def copy_(self, src, non_blocking=False):
        if self.device != src.device:
            copies.append(("copy_", self.device.type, self.is_pinned(), non_blocking))
        return real_copy(self, src, non_blocking=non_blocking)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    swapper.swap_out([(1, 2)])
    swapper.swap_in([(4, 5)])
    monkeypatch.undo()
    crossing = [c for c in copies if c[0] == "copy_" or c[1] == "cpu"]
    assert crossing and all(pinned and non_blocking for _, _, pinned, non_blocking in crossing)
