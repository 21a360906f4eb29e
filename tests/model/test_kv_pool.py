"""The KV pool's allocation (model/attention.allocate_kv_caches): a host pool reads as zeros, is
writable, contiguous and page-aligned, and is not made resident at start-up (its zero pages are
faulted in as blocks are first written), so a 1 GiB pool no longer costs a second of every
start. The probe: RSS grows by the pool's size only once it is written, not when allocated."""

from __future__ import annotations

import os

import pytest
import torch

from tokenweir.model.arch import ArchConfig
from tokenweir.model.attention import allocate_kv_caches

MIB = 2 ** 20


def _arch(num_layers: int, head_dim: int = 16) -> ArchConfig:
    return ArchConfig(architecture="llama", vocab_size=8, hidden_size=4 * head_dim,
                      intermediate_size=8, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                      head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      tie_word_embeddings=True, max_position_embeddings=64)


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_pool_is_zeros_writable_and_aligned(dtype):
    caches = allocate_kv_caches(_arch(3), 10, 16, dtype, "cpu")
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (2, 10, 16, 2, 16) and cache.dtype == dtype
        assert cache.is_contiguous() and cache.data_ptr() % 64 == 0
        assert not cache.any()
    caches[1][0, 3].fill_(2.0)  # each layer its own memory
    assert caches[1].float().sum().item() == 2.0 * 16 * 2 * 16
    assert not caches[0].any() and not caches[2].any()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_host_pool_is_resident_only_once_written():
    # 2 layers x 64 MiB: [2, 512 blocks, 16, 2 heads, 512] float32
    arch = _arch(2, head_dim=512)
    before = _rss_bytes()
    caches = allocate_kv_caches(arch, 512, 16, torch.float32, "cpu")
    pool = sum(c.numel() * c.element_size() for c in caches)
    assert pool == 128 * MIB
    allocated = _rss_bytes()
    for cache in caches:
        cache.fill_(1.0)
    written = _rss_bytes()
    assert allocated - before < pool // 8, "the pool was made resident at allocation"
    assert written - allocated > pool * 0.9  # probe: the RSS measure sees the pool once written
