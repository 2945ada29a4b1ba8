"""Scoring choices: the layout of a scoring step and the log-probabilities read from its logits.

A scoring request holds one stream: a question (its suffix tokens) and the choices it scores
(one, or all of the question's). Its row in req_to_token is

    [doc (sid -1)] [question (sid -1)] [choice_1 (sid 0)] ... [choice_K (sid K-1)]

the stream rule of `parallel` one level deeper: the question is shared by the choices as the
document is by the questions, so choice c sees the document, the question and itself, never
another choice. Every choice's positions start right after the question, as if it were alone.
The logits at the question's last token give every choice's first token; those at token j of
choice c (all but its last) give its token j + 1. A stream whose choices are all one token long
forwards none of them: the question's last logits score them all.

Nothing here decodes: a scoring step is one packed extend of many requests (the scheduler's
`score_step` adds the cascade groups and document hints), and `choice_logprobs` gathers each
choice's tokens from the step's logits: log p(token) = logit - logsumexp(row), summed per
choice, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppqa.engine.runtime.layout import DOC_SID, StepLayout
from ppqa.engine.runtime.request import Request, Stream

# Logit rows one scoring forward reads at most: the step's float32 logits are rows x vocabulary
# (4096 x 128k x 4 bytes = 2 GiB), so a larger batch of ready questions is split.
MAX_LOGIT_ROWS = 4096


@dataclass
class ScoreLayout:
    """The new tokens of a scoring step and where each choice's log-probability comes from.

    rows[g], targets[g]: logit row (of the step's logit_indices) and token id of the g-th
    gathered token; owner[g]: its choice in `choices` (flat: (stream, choice of the stream))."""

    input_ids: torch.Tensor  # [T]
    layout: StepLayout
    counts: list[int]  # new tokens per request
    logit_indices: torch.Tensor  # [R] step rows whose logits are read
    rows: torch.Tensor  # [G]
    targets: torch.Tensor  # [G]
    owner: torch.Tensor  # [G]
    choices: list[tuple[Stream, int]]


def forwards_choices(choice_ids: Sequence[Sequence[int]]) -> bool:
    """Whether a stream's choice tokens go through the model (not when all are one token)."""
    return any(len(c) > 1 for c in choice_ids)


def logit_rows(stream: Stream) -> int:
    """Logit rows a scoring stream reads: its question's last, and all but the last token of
    each choice it forwards."""
    if not forwards_choices(stream.choice_ids):
        return 1
    return 1 + sum(len(c) - 1 for c in stream.choice_ids)


def split_by_rows(requests: Sequence[Request], limit: int = MAX_LOGIT_ROWS) -> list[list[Request]]:
    """`requests` in order, in batches of at most `limit` logit rows (a request that alone
    reads more is a batch of its own)."""
    batches: list[list[Request]] = []
    rows = 0
    for req in requests:
        need = logit_rows(req.streams[0])
        if not batches or rows + need > limit:
            batches.append([])
            rows = 0
        batches[-1].append(req)
        rows += need
    return batches


def score_layout(requests: Sequence[Request]) -> ScoreLayout:
    """The packed extend of `requests` (one scoring stream each); see the module doc."""
    ids: list[int] = []
    positions: list[int] = []
    sids: list[int] = []
    rows_pos: list[int] = []
    counts: list[int] = []
    logit_at: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    owner: list[int] = []
    choices: list[tuple[Stream, int]] = []
    offset = 0
    for req in requests:
        (stream,) = req.streams
        doc, question = req.doc_len, stream.suffix_ids
        forward = forwards_choices(stream.choice_ids)
        tokens = list(question)
        tok_pos = [doc + i for i in range(len(question))]
        tok_sid = [DOC_SID] * len(question)
        q_row = len(logit_at)
        logit_at.append(offset + len(question) - 1)
        for c, choice in enumerate(stream.choice_ids):
            flat = len(choices)
            choices.append((stream, c))
            rows.append(q_row)
            targets.append(choice[0])
            owner.append(flat)
            if not forward:
                continue
            first = len(tokens)
            tokens.extend(choice)
            tok_pos.extend(doc + len(question) + j for j in range(len(choice)))
            tok_sid.extend([c] * len(choice))
            for j in range(len(choice) - 1):
                rows.append(len(logit_at))
                logit_at.append(offset + first + j)
                targets.append(choice[j + 1])
                owner.append(flat)
        ids.extend(tokens)
        positions.extend(tok_pos)
        sids.extend(tok_sid)
        rows_pos.extend(doc + i for i in range(len(tokens)))
        counts.append(len(tokens))
        offset += len(tokens)
    layout = StepLayout(torch.tensor(positions, dtype=torch.int64),
                        torch.tensor(sids, dtype=torch.int32),
                        torch.tensor(rows_pos, dtype=torch.int64))
    return ScoreLayout(torch.tensor(ids, dtype=torch.int64), layout, counts,
                       torch.tensor(logit_at, dtype=torch.int64),
                       torch.tensor(rows, dtype=torch.int64),
                       torch.tensor(targets, dtype=torch.int64),
                       torch.tensor(owner, dtype=torch.int64), choices)


def choice_logprobs(logits: torch.Tensor, plan: ScoreLayout) -> list[float]:
    """Each choice's summed log-probability (float32), in `plan.choices` order. Only the
    rows' log-sum-exp is computed, not a log-softmax of the whole [R, vocab] block."""
    device = logits.device
    logits = logits.float()
    rows, targets = plan.rows.to(device), plan.targets.to(device)
    picked = logits[rows, targets] - torch.logsumexp(logits, dim=-1)[rows]
    sums = torch.zeros(len(plan.choices), dtype=torch.float32, device=device)
    sums.index_add_(0, plan.owner.to(device), picked)
    return sums.tolist()
