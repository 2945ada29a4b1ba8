"""KV memory in layers: slot allocator -> KV pool tensors -> req_to_token rows -> document cache.

- `SlotAllocator` (plain Python): free token slots as sorted runs, first fit, so documents and
  request reservations come out contiguous whenever the pool is not fragmented. Slot 0 is never
  handed out: it is the sink for padding and finished streams.
- `KVPool`: one tensor holding K and V of every layer ([2, layers, slots, kv_heads, head_dim]),
  with per-layer views `k_buffers[l]`/`v_buffers[l]`, and `slot_sid` (the stream id of every slot,
  written by the runner before each forward, read by the attention backend).
- `ReqToTokenTable`: rows of slot ids; a request's row starts with its document's slots (shared,
  not copied). Row 0 is a dummy row of sink slots for padded requests (CUDA graphs); row 1 is
  scratch, through which document prefill writes.
- `DocumentCache`: a document's tokens are prefilled once; its slots are reference counted by the
  requests that use it and the least recently used unused documents are evicted when a new
  allocation does not fit. It outlives `Engine.run` calls. A new document that starts with the
  tokens of a cached one (the same document with a longer shared prefix, as when the questions'
  common opening joins it) copies that part's K/V (`KVPool.copy_slots`) and prefills the rest.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


class SlotAllocator:
    """Free slots [1, num_slots) kept as sorted (start, length) runs."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"a KV pool needs at least 2 slots (slot 0 is the sink), got {num_slots}")
        self.num_slots = num_slots
        self._runs: list[tuple[int, int]] = [(1, num_slots - 1)]
        self.num_free = num_slots - 1

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (all but the sink)."""
        return self.num_slots - 1

    def alloc(self, n: int, *, high: bool = False) -> torch.Tensor | None:
        """n slots (int64, CPU): one contiguous run if any is long enough, else the first free
        ones. `high`: from the pool's far end instead (the last run that fits, its last
        slots), for short-lived reservations, so that they do not cut the runs that
        documents take from the near end."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.num_free:
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        order = range(len(self._runs) - 1, -1, -1) if high else range(len(self._runs))
        for i in order:
            if self._runs[i][1] >= n:
                self.num_free -= n
                first = self._take(i, n, high)
                return torch.arange(first, first + n, dtype=torch.int64)
        pieces, need = [], n
        while need:
            i = len(self._runs) - 1 if high else 0
            take = min(self._runs[i][1], need)
            first = self._take(i, take, high)
            pieces.append(torch.arange(first, first + take, dtype=torch.int64))
            need -= take
        self.num_free -= n
        return torch.cat(pieces)

    def _take(self, i: int, n: int, high: bool) -> int:
        """n slots off free run i, its last ones if `high` else its first; the first slot."""
        start, length = self._runs[i]
        rest = (start, length - n) if high else (start + n, length - n)
        self._runs[i:i + 1] = [rest] if length > n else []
        return start + length - n if high else start

    def longest_run(self) -> int:
        """The most free slots in one run."""
        return max((length for _, length in self._runs), default=0)

    def free_runs(self) -> list[tuple[int, int]]:
        """The free (start, length) runs, in slot order."""
        return list(self._runs)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        ordered = torch.sort(slots.to(device="cpu", dtype=torch.int64)).values
        if int(ordered[0]) < 1 or int(ordered[-1]) >= self.num_slots:
            raise ValueError(f"freeing slots outside [1, {self.num_slots}): "
                             f"{int(ordered[0])}..{int(ordered[-1])}")
        breaks = (torch.nonzero(ordered[1:] != ordered[:-1] + 1).flatten() + 1).tolist()
        bounds = [0, *breaks, ordered.numel()]
        new_runs = [(int(ordered[a]), b - a) for a, b in itertools.pairwise(bounds)]
        merged: list[tuple[int, int]] = []
        for start, length in sorted(self._runs + new_runs):
            if merged and merged[-1][0] + merged[-1][1] > start:
                raise ValueError(f"slot {start} freed twice (double free in the KV pool)")
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._runs = merged
        self.num_free += int(ordered.numel())


class KVPool:
    """K/V buffers of every layer plus the per-slot stream ids (see `attention/metadata.py`)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.dtype, self.device = dtype, device
        # Zeroed, not empty: padded reads of slot 0 must never meet NaN garbage.
        self.kv = torch.zeros(2, num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype,
                              device=device)
        self.k_buffers = list(self.kv[0].unbind(0))
        self.v_buffers = list(self.kv[1].unbind(0))
        self.slot_sid = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.allocator = SlotAllocator(num_slots)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """K/V of every layer from slots `src` to slots `dst` (disjoint, CPU int64), which become
        document slots (stream -1). Contiguous runs copy as slices; otherwise layer by layer, so
        the gather's temporary holds one layer, not the whole pool's share."""
        n = dst.numel()
        if n == 0:
            return
        d0, s0 = int(dst[0]), int(src[0])
        if _is_run(dst) and _is_run(src):
            self.kv[:, :, d0:d0 + n].copy_(self.kv[:, :, s0:s0 + n])
            self.slot_sid[d0:d0 + n] = -1
            return
        dst_d, src_d = to_device(dst, self.device), to_device(src, self.device)
        for layer in range(self.kv.shape[1]):
            self.kv[:, layer, dst_d] = self.kv[:, layer, src_d]
        # index_fill_, not `slot_sid[dst_d] = -1`: that copies the scalar from the host and
        # waits for the stream.
        self.slot_sid.index_fill_(0, dst_d, -1)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class ReqToTokenTable:
    """[max_requests + 2, max_row_len] int32 slot ids on the device.

    Row 0 is the dummy row: all zeros forever (every position is the sink slot 0), for the padded
    requests of fixed-shape (CUDA graph) steps. Row 1 is scratch for document prefill.

    On a GPU (`deferred`), writes wait on the host and reach the device together when `table`
    is next read (every step's `ModelRunner.prepare` reads it): one pinned copy and one scatter
    for an admission's hundreds of rows. Pinned staging per row cost a page-locked allocation
    each while the step in flight held the last ones, ~0.2 s of idle GPU per labeling pass
    (results/h200/gprof_labeling_auto_s22c1.json, `admit`).
    """

    DUMMY_ROW = 0
    SCRATCH_ROW = 1

    def __init__(self, max_requests: int, max_row_len: int, device: torch.device,
                 deferred: bool | None = None) -> None:
        self.max_row_len = max_row_len
        self._table = torch.zeros(max_requests + 2, max_row_len, dtype=torch.int32,
                                  device=device)
        self._free_rows = list(range(max_requests + 1, 1, -1))
        self.scratch_row = self.SCRATCH_ROW
        self.deferred = torch.device(device).type == "cuda" if deferred is None else deferred
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # (row, start, slots)
        self._pending_ranges: dict[int, list[tuple[int, int]]] = {}

    @property
    def table(self) -> torch.Tensor:
        """The device table with every write so far applied."""
        if self._pending:
            self._flush()
        return self._table

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if row == self.DUMMY_ROW:
            raise ValueError("the dummy row of req_to_token must stay all sink slots")
        end = start + slots.numel()
        if end > self.max_row_len:
            raise ValueError(f"a row of {end} tokens exceeds the req_to_token row length "
                             f"{self.max_row_len}")
        if not self.deferred:
            self._table[row, start:end] = to_device(slots.to(dtype=torch.int32),
                                                    self._table.device)
            return
        ranges = self._pending_ranges.get(row, [])
        if any(a < end and start < b for a, b in ranges):
            self._flush()  # a position written twice: the earlier write lands first
        self._pending_ranges.setdefault(row, []).append((start, end))
        self._pending.append((row, start, slots))

    def _flush(self) -> None:
        """The waiting writes (no position twice) through one pinned copy: slots written to
        several rows at one offset (a document's, into each of its requests' rows) once, each
        such set as one scatter into its rows; the rest as one scatter by flat position."""
        pending, self._pending, self._pending_ranges = self._pending, [], {}
        by_source: dict[tuple[int, int], tuple[torch.Tensor, list[int]]] = {}
        for row, start, slots in pending:
            by_source.setdefault((id(slots), start), (slots, []))[1].append(row)
        positions, values, sets = [], [], []
        for (_, start), (slots, rows) in by_source.items():
            if len(rows) > 1:
                sets.append((start, slots, rows))
            else:
                at = rows[0] * self.max_row_len + start
                positions.append(torch.arange(at, at + slots.numel(), dtype=torch.int64))
                values.append(slots.to(dtype=torch.int64))
        parts = [torch.cat(positions), torch.cat(values)] if positions else []
        for _, slots, rows in sets:
            parts += [slots.to(dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)]
        staged = to_device(torch.cat(parts), self._table.device)
        pieces = iter(staged.split([p.numel() for p in parts]))
        if positions:
            flat, flat_values = next(pieces), next(pieces)
            self._table.view(-1).index_copy_(0, flat, flat_values.to(torch.int32))
        for start, slots, _ in sets:
            set_values, rows = next(pieces), next(pieces)
            self._table[rows, start:start + slots.numel()] = set_values.to(torch.int32)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to a GPU through pinned memory without blocking: a copy from
    pageable memory waits for the stream, i.e. for the decode step in flight, and an admission
    writes hundreds of table rows, each such a wait that leaves the GPU idle after the first."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _is_run(slots: torch.Tensor) -> bool:
    n = slots.numel()
    return n == 0 or int(slots[-1]) - int(slots[0]) == n - 1 and bool((slots.diff() == 1).all())


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
        if n and _is_run(self.slots.cpu()):
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
        (`CachedDocument.copied`), which is kept from eviction until its K/V are copied."""
        ids = np.asarray(token_ids, dtype=np.int64)
        base, shared = self._best_base(ids)
        if base is not None:
            self.acquire(base)
        slots = self.alloc(len(token_ids))
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

    def _evict_for_run(self, n: int) -> None:
        """Unused documents next to each other and to free runs, together a run of n slots:
        the window of them that evicts the fewest document slots (at most 2n; the least
        recently used on a tie) is evicted, so that a new document of n tokens is one run.
        A document gathered from pieces is read slot by slot in every step that attends to it
        (a slower kernel and a decode graph of its own: results/h200/
        gprof_labeling_auto_s22c2.json, `captured_keys`), where an eviction costs one more
        prefill if the evicted document comes back. Nothing is evicted when no such window
        exists."""
        # Segments in slot order: free runs and unused documents' runs; anything else (a
        # document in use, a request's slots) separates windows.
        segments = [(start, length, None) for start, length in self.allocator.free_runs()]
        segments += [(d.start, d.length, d) for d in self._docs.values()
                     if d.ref_count == 0 and d.start >= 0]
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
        if best is not None:
            for doc in best[1]:
                self.drop(doc)

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
