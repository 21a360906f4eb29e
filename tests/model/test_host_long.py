"""transfer.host_long builds the same CPU int64 tensor as torch.tensor(list, dtype=long)."""

import torch

from tokenweir.model.transfer import host_long


def test_host_long_equals_torch_tensor():
    for values in ([], [0], [5, -3, 2**40, -(2**62)], list(range(3000))):
        made, ref = host_long(values), torch.tensor(values, dtype=torch.long)
        assert made.dtype == torch.long and made.shape == ref.shape and made.is_contiguous()
        assert torch.equal(made, ref)


def test_host_long_owns_its_values():
    """The tensor keeps its buffer alive after the list and any array are gone."""
    made = host_long([7] * 100)
    del_list = [1, 2, 3]
    other = host_long(del_list)
    del del_list
    assert made.sum().item() == 700 and other.tolist() == [1, 2, 3]
