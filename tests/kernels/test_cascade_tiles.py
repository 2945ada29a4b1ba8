"""The warm-up's pass over the cascade document kernel's tiles: it launches one tile for every
tile class a group size can choose, over gathered and contiguous documents, so that no session
meets a tile its warm-up did not (on a GPU: launches after it compile nothing)."""

from __future__ import annotations

import pytest
import torch
from checks import DEVICE, HEADS, ON_GPU

from ppqa.engine.attention.triton_backend import TritonBackend
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.kernels import cascade

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
MAX_ROWS = 300


def _backend(heads, kv_heads, dim) -> tuple[TritonBackend, ReqToTokenTable]:
    pool = KVPool(64, 1, kv_heads, dim, dtype=DTYPE, device=DEVICE)
    return (TritonBackend(pool, heads, kv_heads, dim, dim ** -0.5, scratch_bytes=1 << 20),
            ReqToTokenTable(4, 64, DEVICE))


def _variants() -> int:
    """The kernel's compiled variants on this GPU (Triton's in-memory cache)."""
    caches = cascade._prefix_kernel.device_caches
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_the_warmup_launches_every_tile_a_group_can_choose(heads):
    num_heads, kv_heads, dim = heads
    backend, table = _backend(num_heads, kv_heads, dim)
    group = num_heads // kv_heads
    # Every row count, not only the powers of two the warm-up walks: a tile threshold anywhere
    # else would leave a class unmet.
    classes = {(contiguous, *cascade.tiling(DEVICE, DTYPE, group, rows, contiguous=contiguous)[:2])
               for contiguous in (False, True) for rows in range(1, MAX_ROWS + 1)}
    assert len(classes) >= 3  # several query-tile heights, both document layouts
    assert backend.warm_cascade_tiles(table.table, MAX_ROWS) == len(classes)
    if not ON_GPU:
        return
    before = _variants()
    q = torch.zeros(1, num_heads, dim, dtype=DTYPE, device=DEVICE)
    ints = dict(dtype=torch.int32, device=DEVICE)
    part_o, part_lse = backend.scratch.views(1, num_heads, 1, dim)
    pool = backend.pool
    for rows in (1, 3, 12, 17, 40, 64, 65, 100, 250, MAX_ROWS):
        for starts in (None, torch.tensor([1], **ints)):
            cascade.launch_shared_prefix(
                q, pool.k_buffers[0], pool.v_buffers[0], table.table,
                torch.tensor([0, 1], **ints), torch.tensor([0], **ints),
                torch.tensor([16], **ints), rows, backend.sm_scale, 1, part_o, part_lse,
                doc_starts=starts)
    torch.cuda.synchronize()
    assert _variants() == before, "a group size met a tile the warm-up did not compile"
