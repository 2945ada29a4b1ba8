"""The req_to_token table on a GPU: an admission writes hundreds of rows while a decode step
is in flight, and a write must not wait for the device (a copy from pageable host memory
synchronises the stream; CUDA's sync debug mode turns any such wait into an error here)."""

import pytest
import torch

from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_table_writes_and_scattered_copies_do_not_wait_for_the_device():
    cuda = torch.device("cuda")
    table = ReqToTokenTable(8, 64, cuda)
    pool = KVPool(64, 2, 2, 16, dtype=torch.bfloat16, device=cuda)
    pool.kv.normal_()
    slots = torch.arange(5, 25)
    src, dst = torch.tensor([3, 9, 4]), torch.tensor([40, 50, 41])  # not runs: the gather path
    busy = torch.randn(2048, 2048, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # device work in flight meanwhile
            busy = busy @ busy / 2048 ** 0.5
        table.write(2, 0, slots[:10])
        table.write(2, 10, slots[10:])
        for row in (3, 4):  # one document's slots into two rows: staged once, one write
            table.write(row, 0, slots)
        assert table.table.is_cuda  # the waiting writes land: one pinned copy, two scatters
        pool.copy_slots(dst, src)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert table.table[2:5, :20].cpu().tolist() == [slots.tolist()] * 3
    assert torch.equal(pool.kv[:, :, dst].cpu(), pool.kv[:, :, src].cpu())
    assert pool.slot_sid[dst].cpu().tolist() == [-1, -1, -1]
