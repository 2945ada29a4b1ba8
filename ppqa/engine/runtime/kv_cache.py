"""KV memory in layers: slot allocator -> KV pool tensors -> req_to_token rows (the document
cache above them is `document_cache.py`).

- `SlotAllocator` (plain Python): free token slots as sorted runs, first fit, so documents and
  request reservations come out contiguous whenever the pool is not fragmented. Slot 0 is never
  handed out: it is the sink for padding and finished streams.
- `KVPool`: one tensor holding K and V of every layer ([2, layers, slots, kv_heads, head_dim]),
  with per-layer views `k_buffers[l]`/`v_buffers[l]`, and `slot_sid` (the stream id of every slot,
  written by the runner before each forward, read by the attention backend).
- `ReqToTokenTable`: rows of slot ids; a request's row starts with its document's slots (shared,
  not copied). Row 0 is a dummy row of sink slots for padded requests (CUDA graphs); row 1 is
  scratch, through which document prefill writes.
"""

from __future__ import annotations

import itertools
import math

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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU from calloc'd memory (numpy's zeros), whose pages the OS maps, as
    zeros, when first touched: a CPU pool sized for 65k tokens then costs neither clearing it
    (0.48 s for SmolLM2's 3 GB, benchmarks/NOTES.md "CPU: a GGUF model's start-up") nor the
    memory of slots no request reaches."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(size, dtype=np.uint8)).view(dtype).reshape(shape)


class KVPool:
    """K/V buffers of every layer plus the per-slot stream ids (see `attention/metadata.py`)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.dtype, self.device = dtype, device
        # Zeroed, not empty: padded reads of slot 0 must never meet NaN garbage.
        self.kv = zeros((2, num_layers, num_slots, num_kv_heads, head_dim), dtype, device)
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
        if is_run(dst) and is_run(src):
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


def is_run(slots: torch.Tensor) -> bool:
    n = slots.numel()
    return n == 0 or int(slots[-1]) - int(slots[0]) == n - 1 and bool((slots.diff() == 1).all())
