"""Stream layout: where each new token of a step goes, at which rotary position, with which stream id.

A `parallel` request's row in req_to_token is
    [doc (sid -1)] [q_1 (sid 0)] ... [q_P (sid P-1)] [step-1 tokens of the live streams] [step 2] ...
Stream s's positions start at the document length L, as if its question were alone: question s
token i sits at position L + i, answer token t at L + len(q_s) + t. A finished stream keeps its
place in the step (fixed shape (B, P)) but is not appended to the row: its token goes to the sink
slot 0 (`row_pos` -1 here). `stock` and `cascade` requests are the P = 1 case.

Everything here is pure torch on the CPU, vectorized over the batch; the scheduler calls it to
build a step's host inputs and the runner turns row positions into slots through req_to_token.
`extend_mask` is the dense form of the stream rule that the torch backend applies and the
layout tests check against a reference:
    query t may attend key k  iff  causal(t, k) and (sid_k == -1 or sid_k == q_sid[t]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DOC_SID = -1


@dataclass
class StepLayout:
    """Per new token of one request (or a batch): rotary position, stream id, row position."""

    positions: torch.Tensor  # [T] int64
    q_sid: torch.Tensor  # [T] int32
    row_pos: torch.Tensor  # [T] int64 position in the request's row, -1: written to the sink slot 0


def document_layout(start: int, end: int) -> StepLayout:
    """Document tokens [start, end): positions = row positions, stream -1."""
    rows = torch.arange(start, end, dtype=torch.int64)
    return StepLayout(rows.clone(), torch.full((end - start,), DOC_SID, dtype=torch.int32), rows)


def question_layout(doc_len: int, question_lens: Sequence[int]) -> tuple[StepLayout, torch.Tensor]:
    """Packed prefill of the questions of one request, and the index of each question's last token.

    The logits of question s's last token give stream s its first answer token.
    """
    if len(question_lens) == 1 and question_lens[0] >= 1:
        # One question (every stock and cascade request; a question prefill builds hundreds):
        # the same layout without the packing's tensor ops, a quarter of the host time.
        n = int(question_lens[0])
        rows = torch.arange(doc_len, doc_len + n, dtype=torch.int64)
        return (StepLayout(positions=rows.clone(), q_sid=torch.zeros(n, dtype=torch.int32),
                           row_pos=rows),
                torch.tensor([n - 1], dtype=torch.int64))
    lens = torch.tensor(list(question_lens), dtype=torch.int64)
    if lens.numel() == 0 or int(lens.min()) < 1:
        raise ValueError(f"every question needs at least one token, got lengths {list(question_lens)}")
    total = int(lens.sum())
    stream = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int64), lens)
    starts = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, dtype=torch.int64) - starts[stream]
    layout = StepLayout(positions=doc_len + within, q_sid=stream.to(torch.int32),
                        row_pos=doc_len + torch.arange(total, dtype=torch.int64))
    return layout, torch.cumsum(lens, 0) - 1


def decode_layout(prefix_lens: torch.Tensor, next_pos: torch.Tensor,
                  live: torch.Tensor) -> tuple[StepLayout, torch.Tensor]:
    """One new token per stream for B requests of P streams, and the new prefix lengths.

    prefix_lens [B]: row tokens cached before the step; next_pos [B, P]: each stream's next rotary
    position; live [B, P] bool: streams still generating. Live tokens take the next row positions in
    stream order; dead ones go to the sink.
    """
    batch, width = next_pos.shape
    live_i = live.to(torch.int64)
    rank = torch.cumsum(live_i, dim=1) - 1
    row_pos = torch.where(live, prefix_lens.view(batch, 1) + rank, torch.full_like(rank, -1))
    q_sid = torch.arange(width, dtype=torch.int32).repeat(batch)
    layout = StepLayout(next_pos.reshape(-1).to(torch.int64), q_sid, row_pos.reshape(-1))
    return layout, prefix_lens + live_i.sum(dim=1)


def stream_rule(query_sid: torch.Tensor, key_sid: torch.Tensor) -> torch.Tensor:
    """[n, m] bool: the stream part of the rule (causality is the caller's)."""
    key = key_sid.view(1, -1)
    return (key == DOC_SID) | (key == query_sid.view(-1, 1))


def extend_mask(cached_sid: torch.Tensor, new_sid: torch.Tensor) -> torch.Tensor:
    """[n, m + n] bool mask of n new tokens over m cached keys (stage 1) then themselves (stage 2).

    Cached keys are all causally earlier; new token j is causally before new token i iff j <= i.
    """
    n = new_sid.numel()
    stage1 = stream_rule(new_sid, cached_sid)
    causal = torch.ones(n, n, dtype=torch.bool, device=new_sid.device).tril()
    stage2 = stream_rule(new_sid, new_sid) & causal
    return torch.cat([stage1, stage2], dim=1)
