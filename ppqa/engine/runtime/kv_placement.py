"""Where an admitted request's KV lives: its req_to_token row, its document in the cache, and the
slots reserved for its questions and answers.

The scheduler decides which request to admit; `KVPlacement` says whether the memory holds it
and takes or gives back that memory. A request is placed whole or not at all (`place`): a row,
a reference to its document (cached, or inserted into the pool, evicting unused documents),
and a reservation of every question and its whole answer budget, so that a running request
never runs out of KV. `release` gives all three back, many requests' slots merged into the free
runs at once.

Data flow: scheduler (`admit`) -> `place` -> DocumentCache / KVPool / ReqToTokenTable ->
request (`doc`, `row`, `slots`, `prefix_len`); scheduler (a request finished, cancelled or
retired) -> `release`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ppqa.engine.runtime.document_cache import DocumentCache
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.request import Request


class KVPlacement:
    def __init__(self, pool: KVPool, table: ReqToTokenTable, docs: DocumentCache) -> None:
        self.pool, self.table, self.docs = pool, table, docs

    def place(self, req: Request) -> bool:
        """Give `req` a row, its document and its reserved slots; False (nothing taken) where
        the table or the pool cannot."""
        if self.table.num_free_rows == 0:
            return False
        doc = self.docs.get(req.doc_ids, req.doc_key)
        if doc is None:
            doc = self.docs.insert(req.doc_ids, req.doc_key)
            if doc is None:
                return False
        self.docs.acquire(doc)  # pinned before the reservation so eviction cannot take it
        # A request's own slots come from the pool's far end: freed when it finishes, they
        # would otherwise leave holes between documents, and a document that finds no run
        # long enough is gathered slot by slot in every decode step (a slower kernel and a
        # graph of its own).
        slots = self.docs.alloc(req.reserve_tokens, high=True)
        if slots is None:
            self.docs.release(doc)
            return False
        row = self.table.alloc()
        self.table.write(row, 0, doc.slots)
        self.table.write(row, doc.length, slots)
        req.doc, req.row, req.slots, req.prefix_len = doc, row, slots, doc.length
        return True

    def holds_group(self, group: Sequence[Request]) -> bool:
        """Whether the pool holds a group of requests about one document, none of them placed
        yet: their document as one run (cached already, or room for one) and every
        reservation, without evicting a document in use."""
        head = group[0]
        cached = self.docs.get(head.doc_ids, head.doc_key)
        if cached is None and not self.docs.holds_run(len(head.doc_ids)):
            return False
        need = sum(r.reserve_tokens for r in group) + (0 if cached else len(head.doc_ids))
        return need <= self.pool.allocator.num_free + self.docs.unused_slots(besides=cached)

    def release(self, requests: Sequence[Request]) -> bool:
        """Give back the slots, row and document reference of every placed request in
        `requests`, their slots merged into the free runs at once (a step that ends a whole
        batch frees hundreds of requests: one by one, each merge walks every free run again).
        Returns whether any was placed."""
        done = [r for r in requests if r.row >= 0]
        if not done:
            return False
        slots = [r.slots for r in done if r.slots is not None and r.slots.numel()]
        if slots:
            self.pool.allocator.free(torch.cat(slots) if len(slots) > 1 else slots[0])
        for req in done:
            self.table.free(req.row)
            self.docs.release(req.doc)
            req.row, req.slots = -1, None
        return True

    def describe(self) -> str:
        """The pool's and the table's room, for an error message."""
        return (f"{self.pool.allocator.capacity} slots ({self.pool.allocator.num_free} free, "
                f"{self.table.num_free_rows} free rows)")
