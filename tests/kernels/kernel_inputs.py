"""Test inputs laid out exactly like the engine's rows, for the attention kernel tests.

parallel: one request per group of P streams, row [doc][q_1..q_P][a1_1..a1_P][a2_1..a2_P]...,
slot_sid -1 for the document and s for stream s's tokens; a step's new tokens are the row's
tail (the document at "doc" prefill, the packed questions at "questions", one answer token per
stream at decode step k). stock/cascade: one request per question, row [doc][q_s][a_s...].
Every request of a document shares the document's slots; slots come from a shuffled free list so
the kernels' gathers are exercised; unused slots carry a junk stream id (77) and random K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

JUNK_SID = 77


class Pool:
    """Random K/V slots, slot 0 the sink, handed out in shuffled order."""

    def __init__(self, num_slots, num_kv_heads, head_dim, dtype, device, gen):
        self.k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.slot_sid = torch.full((num_slots,), JUNK_SID, dtype=torch.int32)
        self.free = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()

    def take(self, n: int, sid: int | list[int]) -> list[int]:
        slots, self.free = self.free[:n], self.free[n:]
        assert len(slots) == n, "test pool too small"
        self.slot_sid[slots] = torch.tensor(sid if isinstance(sid, list) else [sid] * n,
                                            dtype=torch.int32)
        return slots


@dataclass
class Batch:
    """Kernel inputs for one step; every tensor on the test device."""

    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    req_to_token: torch.Tensor  # [B, max_row] int32
    req_indices: torch.Tensor  # [B] int32
    kv_start: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32: cached positions before the new tokens
    qo_indptr: torch.Tensor  # [B+1] int32
    q_sid: torch.Tensor  # [T] int32
    slot_sid: torch.Tensor  # [S] int32
    max_extend_len: int


def _tensors(rows, new_counts, new_sids, kv_starts, pool, num_heads, head_dim, gen, device):
    """Pack per-request rows (slot lists) into the engine's tensors; rows include new tokens."""
    batch = len(rows)
    width = max(len(r) for r in rows) + 3  # a little slack, filled with junk slots
    table = torch.randint(1, pool.k.shape[0], (batch, width), generator=gen, dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(new_counts), 0)
    total, hkv = int(indptr[-1]), pool.k.shape[1]
    dtype = pool.k.dtype
    to = dict(device=device, dtype=torch.int32)
    return Batch(
        q=torch.randn(total, num_heads, head_dim, generator=gen).to(dtype).to(device),
        k_new=torch.randn(total, hkv, head_dim, generator=gen).to(dtype).to(device),
        v_new=torch.randn(total, hkv, head_dim, generator=gen).to(dtype).to(device),
        req_to_token=table.to(device),
        req_indices=torch.arange(batch, **to),
        kv_start=torch.tensor(kv_starts, **to),
        prefix_lens=torch.tensor([len(r) - n for r, n in zip(rows, new_counts)], **to),
        qo_indptr=indptr.to(device),
        q_sid=torch.tensor(sum(new_sids, []), **to),
        slot_sid=pool.slot_sid.to(device),
        max_extend_len=max(new_counts),
    )


def parallel_step(pool, doc_len, question_lens, phase, num_heads, head_dim, gen, device):
    """question_lens: per request, per stream. phase: "doc", "questions" or decode step k >= 1."""
    doc = pool.take(doc_len, -1)
    if phase == "doc":
        return _tensors([doc], [doc_len], [[-1] * doc_len], [0], pool, num_heads, head_dim, gen,
                        device)
    rows, counts, sids = [], [], []
    for lens in question_lens:
        row, streams = list(doc), len(lens)
        question_sids = [s for s, n in enumerate(lens) for _ in range(n)]
        row += pool.take(len(question_sids), question_sids)
        steps = 0 if phase == "questions" else phase
        for _ in range(steps):
            row += pool.take(streams, list(range(streams)))
        rows.append(row)
        counts.append(len(question_sids) if phase == "questions" else streams)
        sids.append(question_sids if phase == "questions" else list(range(streams)))
    return _tensors(rows, counts, sids, [0] * len(rows), pool, num_heads, head_dim, gen, device)


def decode_step(pool, doc_lens, suffix_lens, num_heads, head_dim, gen, device, cascade=False):
    """One token per request; requests grouped by document (suffix_lens[g] per request of doc g).

    Rows are [doc][own question + answers][new token]; returns (Batch, group_indptr, doc_rows)
    where doc_rows[g] is a request holding document g. With cascade=True kv_start = doc length.
    """
    rows, starts, indptr, doc_rows = [], [], [0], []
    for doc_len, lens in zip(doc_lens, suffix_lens):
        doc = pool.take(doc_len, -1)
        doc_rows.append(len(rows))
        for n in lens:
            rows.append(doc + pool.take(n + 1, 0))
            starts.append(doc_len if cascade else 0)
        indptr.append(len(rows))
    batch = _tensors(rows, [1] * len(rows), [[0]] * len(rows), starts, pool, num_heads, head_dim,
                     gen, device)
    return batch, indptr, doc_rows
