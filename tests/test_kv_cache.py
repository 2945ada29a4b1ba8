"""KV memory bookkeeping: slot allocator, req_to_token rows, document cache (refcounts, LRU eviction)."""

from __future__ import annotations

import pytest
import torch

from ppqa.engine.runtime.document_cache import DocumentCache
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable, SlotAllocator


def test_allocator_is_contiguous_first_fit_and_never_hands_out_the_sink() -> None:
    alloc = SlotAllocator(101)
    assert alloc.capacity == 100 and alloc.num_free == 100
    a = alloc.alloc(30)
    b = alloc.alloc(30)
    assert a.tolist() == list(range(1, 31)) and b.tolist() == list(range(31, 61))
    alloc.free(a)
    c = alloc.alloc(10)  # first fit: the hole left by a
    assert c.tolist() == list(range(1, 11))
    d = alloc.alloc(40)  # no hole of 40 except the tail [61, 101)
    assert d.tolist() == list(range(61, 101))
    assert alloc.num_free == 20
    e = alloc.alloc(20)  # exactly the remaining hole
    assert e.tolist() == list(range(11, 31))
    assert alloc.alloc(1) is None


def test_allocator_gathers_fragments_and_merges_on_free() -> None:
    alloc = SlotAllocator(21)
    pieces = [alloc.alloc(4) for _ in range(5)]  # 1..20
    alloc.free(pieces[0])
    alloc.free(pieces[2])
    alloc.free(pieces[4])
    got = alloc.alloc(10)  # no run of 10: the first free slots, in order
    assert got.tolist() == [1, 2, 3, 4, 9, 10, 11, 12, 17, 18]
    alloc.free(got)
    alloc.free(pieces[1])
    alloc.free(pieces[3])
    assert alloc.num_free == 20
    assert alloc.alloc(20).tolist() == list(range(1, 21))  # merged back into one run


def test_allocator_takes_high_requests_from_the_far_end() -> None:
    alloc = SlotAllocator(21)  # slots 1..20
    assert alloc.alloc(3, high=True).tolist() == [18, 19, 20]
    assert alloc.alloc(4).tolist() == [1, 2, 3, 4]
    alloc.free(torch.tensor([2, 3]))
    assert alloc.alloc(2, high=True).tolist() == [16, 17]  # the last run that fits, its end
    # none long enough: pieces from the far end inwards
    assert alloc.alloc(12, high=True).tolist() == list(range(5, 16)) + [3]
    assert alloc.num_free == 1 and alloc.alloc(2, high=True) is None
    assert alloc.alloc(1).tolist() == [2]


def test_a_new_document_evicts_for_one_run_rather_than_take_pieces() -> None:
    """Freeing just enough slots in total would leave the new document in two pieces: the
    next least recently used document goes too, so that it gets one run."""
    alloc = SlotAllocator(41)  # slots 1..40
    docs = DocumentCache(alloc)
    a, b, c = (docs.insert(list(range(k, k + 8))) for k in (0, 100, 200))
    e = docs.insert(list(range(300, 310)))  # slots 25..34; 35..40 free
    docs.acquire(c)
    docs.acquire(e)
    # Said before it is done, and nothing evicted by the asking: no free run of 10, but a and b
    # with the free slots between them make one; 17 would need c, which is in use.
    assert docs.holds_run(10) and not docs.holds_run(17) and len(docs) == 4
    d = docs.insert(list(range(400, 410)))
    assert d.start == 1 and d.slots.tolist() == list(range(1, 11))
    assert docs.get(a.token_ids) is None and docs.get(b.token_ids) is None
    assert docs.get(c.token_ids) is c and alloc.num_free == 16 - 10 + 6
    # Within its budget only: a document longer than 2n is not evicted for a run.
    alloc2 = SlotAllocator(31)
    docs2 = DocumentCache(alloc2)
    big = docs2.insert(list(range(20)))  # 1..20, unused
    docs2.alloc(4)  # 21..24 (a request's slots); 25..30 free
    docs2.acquire(docs2.insert(list(range(500, 503))))  # 25..27; 28..30 free
    assert docs2._evict_for_run(4) is None and docs2.get(big.token_ids) is big
    assert docs2.holds_run(3) and not docs2.holds_run(4)


def test_allocator_rejects_double_free_and_the_sink() -> None:
    alloc = SlotAllocator(11)
    a = alloc.alloc(5)
    alloc.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(a[:2])
    with pytest.raises(ValueError, match="outside"):
        alloc.free(torch.tensor([0]))


def test_freeing_many_requests_at_once_leaves_what_one_by_one_leaves() -> None:
    """KVPlacement.release frees several requests' slots as one set: the free runs and the
    count come out as freeing them one at a time would leave them; an overlap is a double free."""
    def allocate(alloc: SlotAllocator) -> list[torch.Tensor]:
        parts = [alloc.alloc(n) for n in (7, 3, 11, 5, 9)]
        alloc.free(parts[1])  # a hole, so the later requests come out fragmented
        parts.append(alloc.alloc(6))
        return [p for i, p in enumerate(parts) if i != 1]

    one, many = SlotAllocator(39), SlotAllocator(39)  # slots 1..38: no run of 6 after the hole
    parts_one, parts_many = allocate(one), allocate(many)
    assert any(p.numel() > 1 and bool((p.diff() != 1).any()) for p in parts_many)  # fragmented
    for p in (parts_one[0], parts_one[2], parts_one[4]):
        one.free(p)
    many.free(torch.cat([parts_many[0], parts_many[2], parts_many[4]]))
    assert many._runs == one._runs and many.num_free == one.num_free
    with pytest.raises(ValueError, match="twice"):
        many.free(torch.cat([parts_many[1], parts_many[1][:1]]))


def test_pool_views_share_one_tensor() -> None:
    pool = KVPool(9, 3, 2, 4, dtype=torch.float32, device=torch.device("cpu"))
    pool.k_buffers[1][5] = 7.0
    pool.v_buffers[2][3] = 1.0
    assert pool.kv[0, 1, 5].eq(7.0).all() and pool.kv[1, 2, 3].eq(1.0).all()
    assert pool.slot_sid.tolist() == [-1] * 9
    assert KVPool.bytes_per_slot(3, 2, 4, torch.bfloat16) == 2 * 3 * 2 * 4 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_pool_starts_as_zeros_of_its_dtype_that_take_writes(dtype) -> None:
    """The CPU pool comes from calloc'd memory (kv_cache.zeros): zeros, of the pool's dtype and
    shape, one tensor its views write into, and a second pool shares nothing with the first."""
    pools = [KVPool(300, 2, 3, 8, dtype=dtype, device=torch.device("cpu")) for _ in range(2)]
    first, second = pools
    assert first.kv.dtype == dtype and first.kv.shape == (2, 2, 300, 3, 8)
    assert first.kv.eq(0).all() and first.kv.is_contiguous()
    first.v_buffers[1][299] = -2.5
    assert first.kv[1, 1, 299].eq(-2.5).all() and first.kv.ne(0).sum() == 3 * 8
    assert second.kv.eq(0).all()


def test_table_rows_and_row_length_check() -> None:
    table = ReqToTokenTable(2, 8, torch.device("cpu"))
    rows = {table.alloc(), table.alloc()}
    assert rows == {2, 3} and table.alloc() is None  # rows 0 (dummy) and 1 (scratch) are never handed out
    table.write(2, 2, torch.tensor([5, 6]))
    assert table.table[2, :4].tolist() == [0, 0, 5, 6]
    with pytest.raises(ValueError, match="row length 8"):
        table.write(2, 6, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="dummy row"):
        table.write(0, 0, torch.tensor([1]))


def test_deferred_table_writes_land_together_and_later_writes_win() -> None:
    """As on a GPU: writes wait until the table is read, and one that rewrites positions
    still waiting (a row freed and taken again before a step) lands after the first."""
    table = ReqToTokenTable(3, 8, torch.device("cpu"), deferred=True)
    table.write(2, 0, torch.tensor([7, 8, 9]))
    table.write(3, 4, torch.tensor([1, 2]))
    table.write(2, 3, torch.tensor([10]))
    assert table._table[2].tolist() == [0] * 8  # nothing has landed yet
    assert table.table[2, :4].tolist() == [7, 8, 9, 10]
    assert table.table[3].tolist() == [0, 0, 0, 0, 1, 2, 0, 0]
    table.write(2, 0, torch.tensor([4, 4]))
    table.write(2, 1, torch.tensor([5, 5, 5]))  # overlaps the write waiting before it
    assert table.table[2, :5].tolist() == [4, 5, 5, 5, 0]
    with pytest.raises(ValueError, match="row length 8"):
        table.write(2, 7, torch.tensor([1, 2]))
    doc = torch.tensor([11, 12, 13])  # one document's slots into several rows, once
    for row in (2, 3, 4):
        table.write(row, 1, doc)
        table.write(row, 4, torch.tensor([row * 10]))
    assert table.table[2:5].tolist() == [[4, 11, 12, 13, 20, 0, 0, 0],
                                        [0, 11, 12, 13, 30, 2, 0, 0],
                                        [0, 11, 12, 13, 40, 0, 0, 0]]


def test_document_cache_shares_refcounts_and_evicts_least_recently_used() -> None:
    alloc = SlotAllocator(31)
    docs = DocumentCache(alloc)
    a = docs.insert(list(range(10)))
    b = docs.insert(list(range(100, 110)))
    docs.insert(list(range(200, 205)))
    assert a.slots.tolist() == list(range(1, 11)) and alloc.num_free == 5
    assert docs.get(list(range(10))) is a  # lookup by content
    docs.acquire(a)
    docs.acquire(b)
    docs.release(b)  # b used after c: c is now the least recently used unused document
    assert docs.alloc(8) is not None  # needs 3 more slots: evicts c only
    assert docs.get(list(range(200, 205))) is None and docs.get(list(range(100, 110))) is b
    assert docs.alloc(10) is not None  # evicts b; a is in use and stays
    assert len(docs) == 1 and docs.get(list(range(10))) is a
    assert docs.alloc(5) is None  # only a (in use) is left: nothing can be evicted
    with pytest.raises(RuntimeError, match="in use"):
        docs.drop(a)
    docs.release(a)
    with pytest.raises(RuntimeError, match="released more often"):
        docs.release(a)
    docs.clear()
    assert len(docs) == 0 and alloc.num_free == 12


def test_document_cache_insert_fails_cleanly_when_pool_is_full() -> None:
    alloc = SlotAllocator(11)
    docs = DocumentCache(alloc)
    a = docs.insert(list(range(8)))
    docs.acquire(a)
    assert docs.insert(list(range(50, 55))) is None
    assert alloc.num_free == 2 and len(docs) == 1


def filled_pool(num_slots: int = 64) -> KVPool:
    pool = KVPool(num_slots, 2, 2, 4, dtype=torch.float32, device=torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    pool.slot_sid.fill_(5)  # stale stream ids of earlier requests
    return pool


@pytest.mark.parametrize("scattered", [False, True])
def test_copy_slots_copies_every_layer_and_marks_document_slots(scattered: bool) -> None:
    pool = filled_pool()
    src = torch.tensor([3, 9, 4, 20]) if scattered else torch.arange(3, 7)
    dst = torch.arange(30, 34)
    before = pool.kv.clone()
    pool.copy_slots(dst, src)
    torch.testing.assert_close(pool.kv[:, :, dst], before[:, :, src], rtol=0, atol=0)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[dst] = False
    torch.testing.assert_close(pool.kv[:, :, untouched], before[:, :, untouched], rtol=0, atol=0)
    assert pool.slot_sid[dst].tolist() == [-1] * 4 and int(pool.slot_sid[untouched].min()) == 5


def test_document_cache_starts_a_longer_document_from_a_cached_one() -> None:
    pool = filled_pool(101)
    docs = DocumentCache(pool.allocator, pool.copy_slots)
    base = docs.insert(list(range(1, 31)))
    assert base.copied == 0 and not base.ready
    # An unready base has no K/V yet: nothing to copy from.
    assert docs.insert(list(range(1, 31)) + [77]).copied == 0
    base.ready = True
    longer = docs.insert(list(range(1, 31)) + [88, 89])
    assert longer.copied == 30 and not longer.ready
    torch.testing.assert_close(pool.kv[:, :, longer.slots[:30]], pool.kv[:, :, base.slots],
                               rtol=0, atol=0)
    # A shorter document inside a cached one is copied whole: nothing left to prefill.
    shorter = docs.insert(list(range(1, 21)))
    assert shorter.copied == 20 and shorter.ready
    # Sharing fewer than MIN_COPY_TOKENS leading tokens: prefilled from the start.
    assert docs.insert(list(range(1, 5)) + [99] * 20).copied == 0


def test_document_cache_prefills_whole_when_only_evicting_the_base_makes_one_run() -> None:
    """Room enough beside the base, but only in pieces: the new document is one run where the
    base was (and is prefilled whole) instead of two pieces with a copied opening."""
    pool = filled_pool(61)  # slots 1..60
    docs = DocumentCache(pool.allocator, pool.copy_slots)
    base = docs.insert(list(range(1, 21)))  # 1..20
    base.ready = True
    gone = docs.insert(list(range(100, 115)))  # 21..35
    docs.acquire(docs.insert(list(range(200, 210))))  # 36..45, in use
    docs.drop(gone)
    docs.drop(docs.insert(list(range(300, 315))))  # 46..60
    assert pool.allocator.num_free == 30 and pool.allocator.longest_run() == 15
    assert docs.holds_run(25)  # the base and the 15 free slots after it
    longer = docs.insert(list(range(1, 21)) + list(range(70, 75)))  # 25 tokens
    assert longer is not None and longer.copied == 0 and longer.start == 1
    assert docs.get(list(range(1, 21))) is None


def test_document_cache_prefills_whole_when_only_evicting_the_base_makes_room() -> None:
    pool = filled_pool(41)
    docs = DocumentCache(pool.allocator, pool.copy_slots)
    base = docs.insert(list(range(1, 21)))
    base.ready = True
    # 20 slots left: a 30-token document fits only once the (unused) base is evicted.
    longer = docs.insert(list(range(1, 21)) + list(range(50, 60)))
    assert longer is not None and longer.copied == 0
    assert docs.get(list(range(1, 21))) is None and pool.allocator.num_free == 10
