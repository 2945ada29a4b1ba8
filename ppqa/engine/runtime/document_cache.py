"""The document cache, above the KV memory of `kv_cache.py`: a document's tokens are prefilled
once; its slots (from the `SlotAllocator`) are reference counted by the requests that use it,
and the least recently used unused documents are evicted when a new allocation does not fit.
It outlives `Engine.run` calls. A new document that starts with the tokens of a cached one (the
same document with a longer shared prefix, as when the questions' common opening joins it)
copies that part's K/V (`KVPool.copy_slots`) and prefills the rest.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ppqa.engine.runtime.kv_cache import SlotAllocator, is_run


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Leading elements two int arrays share."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def document_key(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes(),
                           digest_size=16).digest()


@dataclass(eq=False)
class CachedDocument:
    key: bytes
    token_ids: list[int]
    slots: torch.Tensor  # [length] int64, CPU
    ref_count: int = 0
    last_used: int = 0
    ready: bool = False  # prefilled; until then the requests holding it wait for the prefill
    uid: int = field(default=0)
    # Leading tokens whose K/V were copied from another cached document at insertion: the
    # prefill starts here.
    copied: int = 0
    # First slot when the slots are one contiguous run (the usual case: first-fit allocation),
    # else -1. Kernels read a contiguous document with affine addresses instead of gathers.
    start: int = field(init=False, default=-1)
    ids: np.ndarray = field(init=False, repr=False)  # token_ids as an array, for prefix matching

    def __post_init__(self) -> None:
        n = self.slots.numel()
        if n and is_run(self.slots.cpu()):
            self.start = int(self.slots[0])
        self.ids = np.asarray(self.token_ids, dtype=np.int64)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class DocumentCache:
    """Prefilled documents by token content, with reference counts and LRU eviction.

    copy_kv(dst, src): copies K/V between slots (`KVPool.copy_slots`); with it, `insert` starts
    a new document from the cached one that shares the most leading tokens with it."""

    # A shared run shorter than this is prefilled rather than copied (a copy costs a launch
    # per layer when the slots are scattered; a handful of tokens is cheaper to recompute).
    MIN_COPY_TOKENS = 16

    def __init__(self, allocator: SlotAllocator,
                 copy_kv: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.allocator = allocator
        self.copy_kv = copy_kv
        self._docs: dict[bytes, CachedDocument] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._docs)

    def documents(self) -> list[CachedDocument]:
        """The cached documents in the order they were cached (a new list of the live documents)."""
        return list(self._docs.values())

    def get(self, token_ids: list[int], key: bytes | None = None) -> CachedDocument | None:
        """The cached document with these tokens (`key`: their `document_key`, if known)."""
        return self._docs.get(key or document_key(token_ids))

    def acquire(self, doc: CachedDocument) -> None:
        doc.ref_count += 1
        doc.last_used = next(self._clock)

    def release(self, doc: CachedDocument) -> None:
        if doc.ref_count <= 0:
            raise RuntimeError("document released more often than acquired")
        doc.ref_count -= 1
        doc.last_used = next(self._clock)

    def insert(self, token_ids: list[int], key: bytes | None = None) -> CachedDocument | None:
        """Allocate slots for a new (not yet prefilled) document; None if even eviction can't.
        Its leading tokens shared with a prefilled document are copied from that one
        (`CachedDocument.copied`), which is kept from eviction until its K/V are copied; but
        not where keeping it would leave the new document in pieces that evicting it would
        make one run (a gathered document is read by the slower kernel in every step)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        base, shared = self._best_base(ids)
        n = len(token_ids)
        if base is not None and not self.holds_run(n, keeping=base) and self.holds_run(n):
            base, shared = None, 0  # one run only where the base goes: prefill it all
        if base is not None:
            self.acquire(base)
        slots = self.alloc(n)
        if base is not None:
            self.release(base)
            if slots is None:  # room only if the base goes too: prefill everything instead
                base, shared = None, 0
                slots = self.alloc(len(token_ids))
        if slots is None:
            return None
        uid = next(self._clock)
        doc = CachedDocument(key or document_key(token_ids), list(token_ids), slots, last_used=uid,
                             uid=uid)
        if base is not None:
            self.copy_kv(slots[:shared], base.slots[:shared])
            doc.copied = shared
            doc.ready = shared == doc.length
        self._docs[doc.key] = doc
        return doc

    def _best_base(self, ids: np.ndarray) -> tuple[CachedDocument | None, int]:
        """The prefilled document sharing the most leading tokens with `ids` (at least
        MIN_COPY_TOKENS), and how many; (None, 0) without one or without copy_kv."""
        best, best_len = None, 0
        if self.copy_kv is None or ids.size == 0:
            return best, best_len
        for doc in self._docs.values():
            if doc.ready and doc.length > best_len and int(doc.ids[0]) == int(ids[0]):
                shared = common_prefix_len(doc.ids, ids)
                if shared > best_len:
                    best, best_len = doc, shared
        if best_len < self.MIN_COPY_TOKENS:
            return None, 0
        return best, best_len

    def alloc(self, n: int, *, high: bool = False) -> torch.Tensor | None:
        """n slots from the pool, evicting unused documents (least recently used first) if
        needed; `high`: from the pool's far end (`SlotAllocator.alloc`). A document (not
        `high`) evicts for one run first where that takes at most 2n slots of documents
        (`_evict_for_run`)."""
        if not high and n > self.allocator.longest_run():
            self._evict_for_run(n)
        if n > self.allocator.num_free and not self.evict(n - self.allocator.num_free):
            return None
        return self.allocator.alloc(n, high=high)

    def holds_run(self, n: int, keeping: CachedDocument | None = None) -> bool:
        """Whether a new document of n tokens would be one run: a free run that long, or one
        that `_evict_for_run` would make of free runs and unused documents (`keeping` not
        evicted)."""
        return n <= self.allocator.longest_run() or self._run_window(n, keeping) is not None

    def _evict_for_run(self, n: int) -> None:
        """Unused documents next to each other and to free runs, together a run of n slots:
        the window of them that evicts the fewest document slots (at most 2n; the least
        recently used on a tie) is evicted, so that a new document of n tokens is one run.
        A document gathered from pieces is read slot by slot in every step that attends to it
        (a slower kernel and a decode graph of its own: results/h200/
        gprof_labeling_auto_s22c2.json, `captured_keys`), where an eviction costs one more
        prefill if the evicted document comes back. Nothing is evicted when no such window
        exists."""
        for doc in self._run_window(n) or []:
            self.drop(doc)

    def _run_window(self, n: int,
                    keeping: CachedDocument | None = None) -> list[CachedDocument] | None:
        """The unused documents (`keeping` aside) `_evict_for_run` evicts for a run of n slots
        (None: no window of at most 2n document slots makes one)."""
        # Segments in slot order: free runs and unused documents' runs; anything else (a
        # document in use, a request's slots) separates windows.
        segments = [(start, length, None) for start, length in self.allocator.free_runs()]
        segments += [(d.start, d.length, d) for d in self._docs.values()
                     if d.ref_count == 0 and d.start >= 0 and d is not keeping]
        segments.sort(key=lambda seg: seg[0])
        best = None
        for i in range(len(segments)):
            total, cost, docs = 0, 0, []
            for j in range(i, len(segments)):
                start, length, doc = segments[j]
                if j > i and start != segments[j - 1][0] + segments[j - 1][1]:
                    break  # not adjacent: the window ends
                total += length
                if doc is not None:
                    cost += length
                    docs.append(doc)
                if cost > 2 * n:
                    break
                if total >= n:
                    key = (cost, max((d.last_used for d in docs), default=0))
                    if best is None or key < best[0]:
                        best = (key, list(docs))
                    break
        return None if best is None else best[1]

    def unused_slots(self, besides: CachedDocument | None = None) -> int:
        """Slots of the documents no request holds (`besides` aside): what eviction can free."""
        return sum(d.length for d in self._docs.values() if d.ref_count == 0 and d is not besides)

    def evict(self, n: int) -> bool:
        """Evict unused documents until at least n more slots are free; False if impossible."""
        unused = sorted((d for d in self._docs.values() if d.ref_count == 0), key=lambda d: d.last_used)
        if sum(d.length for d in unused) < n:
            return False
        freed = 0
        for doc in unused:
            if freed >= n:
                break
            self.drop(doc)
            freed += doc.length
        return True

    def drop(self, doc: CachedDocument) -> None:
        if doc.ref_count:
            raise RuntimeError(f"cannot evict a document in use ({doc.ref_count} requests)")
        del self._docs[doc.key]
        self.allocator.free(doc.slots)

    def clear(self) -> None:
        for doc in list(self._docs.values()):
            if doc.ref_count == 0:
                self.drop(doc)
