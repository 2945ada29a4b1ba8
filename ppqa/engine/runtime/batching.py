"""The per-request pieces of a step's inputs, gathered into batch tensors: how the scheduler
(runtime/scheduler.py) turns a list of requests into what one forward needs besides tokens and
positions.

    pack_streams: a document's questions split into parallel requests of at most P streams
        that each fit the pool;
    cascade_groups: the (first, end, doc_len, doc start) groups of requests sharing a document;
    doc_runs: each request's contiguous document run (the document hint);
    sampling_rows: the sampling parameters of a step's logit rows;
    grammar_rows: the rows whose streams follow a JSON grammar, with those streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ppqa.engine.runtime.grammar import GrammarRows
from ppqa.engine.runtime.request import Request
from ppqa.engine.runtime.sampling import SamplingBatch


def pack_streams(sizes: Sequence[int], max_streams: int, doc_len: int,
                 limit: int) -> list[list[int]]:
    """Split questions (their reservation sizes: question + answer budget) into requests.

    ceil(n / max_streams) requests of near-equal stream counts, each split further while
    doc_len + its reservation exceeds `limit` (the pool or row capacity). Returns index lists.
    """
    n = len(sizes)
    count = -(-n // max_streams)
    bounds = [round(i * n / count) for i in range(count + 1)]
    pending = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    out: list[list[int]] = []
    while pending:
        group = pending.pop(0)
        if len(group) > 1 and doc_len + sum(sizes[i] for i in group) > limit:
            half = len(group) // 2
            pending[:0] = [group[:half], group[half:]]
        else:
            out.append(group)
    return out


def cascade_groups(requests: Sequence[Request], pad: int, shares: Callable[[Request], bool]
            ) -> list[tuple[int, int, int, int]]:
    """Cascade groups (first, end, doc_len, doc start) of the requests that `shares`
    picks, sorted by document and placed first; the rest, and the padding, form one
    group whose "document" is empty."""
    groups, first, batch = [], 0, len(requests)
    sharing = sum(1 for r in requests if shares(r))
    for b in range(1, sharing + 1):
        if b == sharing or requests[b].doc is not requests[first].doc:
            doc = requests[first].doc
            groups.append((first, b, doc.length, doc.start))
            first = b
    if sharing < batch + pad:
        groups.append((sharing, batch + pad, 0, 0))
    return groups

def doc_runs(requests: Sequence[Request], pad: int) -> dict[str, torch.Tensor]:
    """doc_start / doc_len per request: the document's contiguous slot run (length 0 when
    its slots are scattered, and for padding)."""
    starts = [max(r.doc.start, 0) for r in requests] + [0] * pad
    lens = [r.doc_len if r.doc.start >= 0 else 0 for r in requests] + [0] * pad
    return {"doc_start": torch.tensor(starts), "doc_len": torch.tensor(lens)}

def sampling_rows(requests: Sequence[Request], rows: list[int] | None, pad_rows: int) -> SamplingBatch:
    """Parameters of the step's logit rows: the first rows[i] streams of request i (prefill)
    or all P (decode, rows None), plus `pad_rows` greedy rows for dummy requests. The step
    counter is each stream's scheduled token count before this step."""
    counts = rows if rows is not None else [None] * len(requests)  # [:None]: every stream
    narrow = rows is None and all(r.width == 1 for r in requests)

    def cat(name: str, pad_value) -> torch.Tensor:
        if narrow:  # one row per request (stock and cascade decode): gather scalars
            column = [getattr(r, name)[0] for r in requests] + [pad_value] * pad_rows
            return torch.from_numpy(np.array(column, dtype=getattr(requests[0], name).dtype))
        parts = [getattr(r, name)[:n] for r, n in zip(requests, counts)]
        parts.append(np.full(pad_rows, pad_value, dtype=parts[0].dtype))
        return torch.from_numpy(np.concatenate(parts))
    return SamplingBatch(temperature=cat("temperature", 0.0), top_p=cat("top_p", 1.0),
                         top_k=cat("top_k", 0), seed=cat("seed", 0), step=cat("num_out", 0),
                         all_greedy=all(r.all_greedy for r in requests))


def grammar_rows(requests: Sequence[Request], bases: list[int],
                  fed: list[np.ndarray]) -> GrammarRows | None:
    """The step's logit rows whose streams follow a grammar, with those streams (None: none)."""
    streams, rows = [], []
    for req, base, mask in zip(requests, bases, fed):
        if not req.constrained:
            continue
        if req.width == 1:  # stock and cascade: skip numpy on one-element arrays (hot at B=256)
            if mask[0]:
                streams.append(req.streams[0])
                rows.append(base)
            continue
        for s in np.flatnonzero(mask[:len(req.streams)]).tolist():
            if req.streams[s].matcher is not None:
                streams.append(req.streams[s])
                rows.append(base + s)
    return GrammarRows(streams, rows) if streams else None
