"""store_kv writes each token's K/V into exactly its slot and nowhere else."""

import pytest
import torch
from checks import DEVICE, DTYPES, HEADS

from ppqa.kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_store_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    _, num_kv_heads, head_dim = HEADS[1]
    pools = [torch.randn(300, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
             for _ in range(2)]
    expect = [p.clone() for p in pools]
    slots = (torch.randperm(299, generator=gen)[:37] + 1).to(DEVICE)
    # K and V as views of one fused projection, as the model produces them
    kv = torch.randn(37, 2, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    store_kv(pools[0], pools[1], slots, kv[:, 0], kv[:, 1])
    store_kv_ref(expect[0], expect[1], slots, kv[:, 0], kv[:, 1])
    # equality with the reference also proves every other slot kept its old contents
    assert torch.equal(pools[0], expect[0]) and torch.equal(pools[1], expect[1])
    assert not torch.equal(pools[0][slots], kv[:, 1])  # K and V were not swapped
