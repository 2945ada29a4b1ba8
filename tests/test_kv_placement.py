"""KVPlacement: a request placed whole (row, document, reservation) or not at all, and given back
whole; a group's room judged without placing anything. Real pool, table and document cache."""

from __future__ import annotations

import torch

from ppqa.config import SamplingParams
from ppqa.engine.runtime.document_cache import DocumentCache
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.kv_placement import KVPlacement
from ppqa.engine.runtime.request import Request, Stream

CPU = torch.device("cpu")


def placement(slots: int, rows: int = 4) -> KVPlacement:
    pool = KVPool(slots + 1, 1, 1, 2, dtype=torch.float32, device=CPU)  # slot 0: the sink
    table = ReqToTokenTable(rows, 64, CPU)
    return KVPlacement(pool, table, DocumentCache(pool.allocator))


def request(doc: list[int], question_tokens: int, budget: int) -> Request:
    stream = Stream(key=None, suffix_ids=list(range(100, 100 + question_tokens)),
                    sampling=SamplingParams(max_new_tokens=budget), seed=0,
                    prompt_tokens=len(doc) + question_tokens)
    return Request(doc_ids=doc, streams=[stream], width=1, mode="cascade")


def test_a_placed_request_holds_its_document_then_its_reservation_in_its_row() -> None:
    mem = placement(40)
    doc = list(range(1, 11))
    req = request(doc, 3, 5)
    assert mem.place(req)
    assert req.row >= 0 and req.prefix_len == 10 and req.slots.numel() == 8
    row = mem.table.table[req.row]
    assert row[:10].tolist() == req.doc.slots.tolist()
    assert row[10:18].tolist() == req.slots.tolist()
    assert req.doc.ref_count == 1 and mem.pool.allocator.num_free == 40 - 18
    # A second question about the same document shares its slots and takes only its own.
    other = request(doc, 2, 4)
    assert mem.place(other) and other.doc is req.doc and req.doc.ref_count == 2
    assert mem.pool.allocator.num_free == 40 - 18 - 6


def test_a_request_the_pool_cannot_reserve_for_takes_nothing() -> None:
    mem = placement(20)
    req = request(list(range(1, 11)), 4, 8)  # 10 + 12 > 20
    free_rows = mem.table.num_free_rows
    assert not mem.place(req)
    assert req.row == -1 and req.slots is None
    assert mem.table.num_free_rows == free_rows
    # Its document was inserted but holds no reference: the next insert may evict it.
    assert all(d.ref_count == 0 for d in mem.docs.documents())
    assert mem.pool.allocator.num_free + sum(d.length for d in mem.docs.documents()) == 20


def test_no_free_row_places_nothing() -> None:
    mem = placement(100, rows=1)
    assert mem.place(request([1, 2, 3], 1, 1))
    before = mem.pool.allocator.num_free
    late = request([4, 5, 6], 1, 1)
    assert not mem.place(late) and late.row == -1
    assert mem.pool.allocator.num_free == before and len(mem.docs) == 1


def test_release_gives_back_rows_slots_and_references_once() -> None:
    mem = placement(60)
    doc = list(range(1, 9))
    reqs = [request(doc, 2, 3) for _ in range(3)]
    assert all(mem.place(r) for r in reqs)
    rows = mem.table.num_free_rows
    assert mem.release(reqs[:2])
    assert [r.row for r in reqs] == [-1, -1, reqs[2].row] and reqs[2].row >= 0
    assert reqs[0].slots is None and reqs[2].doc.ref_count == 1
    assert mem.table.num_free_rows == rows + 2
    assert mem.pool.allocator.num_free == 60 - 8 - 5
    assert not mem.release(reqs[:2])  # already given back: nothing to do, nothing freed twice
    assert mem.release(reqs) and reqs[2].doc.ref_count == 0
    assert mem.pool.allocator.num_free == 60 - 8  # the document stays cached, unused


def test_a_group_is_held_only_with_its_document_and_every_reservation() -> None:
    mem = placement(50)
    doc = list(range(1, 21))
    group = [request(doc, 2, 3) for _ in range(6)]  # 20 + 6 x 5 = 50: exactly the pool
    assert mem.holds_group(group)
    assert not mem.holds_group(group + [request(doc, 0, 1)])
    assert mem.pool.allocator.num_free == 50 and len(mem.docs) == 0  # judged, not placed
    # Cached and unused, the document costs nothing more; a document in use is not evicted.
    assert mem.place(group[0]) and mem.release(group[:1])
    assert mem.holds_group(group)
    busy = request(list(range(30, 40)), 1, 1)
    assert mem.place(busy)
    assert not mem.holds_group(group)  # 50 - 12 held by the busy request: 38 < 50
    assert mem.holds_group(group[:3])  # 20 cached + 15 <= 38 free
