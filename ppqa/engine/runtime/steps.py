"""The steps the scheduler builds: a packed question prefill, a scoring extend, a decode step.

Each function turns running requests (runtime/request.py) into one forward's `StepInputs` and
its sampling rows, and advances the requests' counters as the step schedules their tokens, so
that the next step can be built before this one's tokens are read back (`PlannedStep`; the
session keeps one step in flight). The scheduler (scheduler.py) decides which requests a step
serves; these functions only lay them out:

    Scheduler.questions_ready -> prefill_step -> runner (extend) -> sampler
    Scheduler.decode_batches  -> decode_step  -> runner (decode / extend) -> sampler
    scoring requests          -> score_step   -> runner (extend) -> choice log-probabilities
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ppqa.engine.runtime.batching import cascade_groups, doc_runs, grammar_rows, sampling_rows
from ppqa.engine.runtime.layout import StepLayout, decode_layout, document_layout, question_layout
from ppqa.engine.runtime.request import Request
from ppqa.engine.runtime.runner import StepInputs
from ppqa.engine.runtime.sampling import SamplingBatch
from ppqa.engine.runtime.scoring import ScoreLayout, score_layout


@dataclass(eq=False)
class PlannedStep:
    """A built step: its inputs and sampling rows, and which streams it feeds.

    bases[i]: the first logit (and sampled-token) row of requests[i]; fed[i]: [P] bool, the
    streams of requests[i] that this step samples a token for (prefill: every real stream).
    """

    uid: int
    requests: list[Request]
    inputs: StepInputs
    sampling: SamplingBatch
    bases: list[int]
    fed: list[np.ndarray]


def prefill_step(requests: Sequence[Request], uid: int, cascade: bool = False) -> PlannedStep:
    """One packed extend of the questions of newly admitted requests; a logit row per stream.
    Building it starts the answers: every stream is live and its first token scheduled.
    cascade: requests grouped by document, each group's question tokens meet the document
    together (CascadeMetadata) and the per-request part starts after the document; exact
    for any width-1 request, whatever its decode mode."""
    if cascade:
        requests = sorted(requests, key=lambda r: r.doc.uid)
    ids, positions, sids, rows, lasts, counts, bases = [], [], [], [], [], [], []
    offset = rows_out = 0
    for req in requests:
        if req.shared_question is not None:
            # One question for every stream: written once, as the document is; each
            # stream's first token comes from its last position.
            q_len = len(req.shared_question)
            layout = document_layout(req.doc_len, req.doc_len + q_len)
            last = torch.full((len(req.streams),), q_len - 1, dtype=torch.int64)
            ids.extend(req.shared_question)
        else:
            layout, last = question_layout(req.doc_len, req.question_lens)
            ids.extend(i for s in req.streams for i in s.suffix_ids)
        positions.append(layout.positions)
        sids.append(layout.q_sid)
        rows.append(layout.row_pos)
        lasts.append(last + offset)
        counts.append(layout.positions.shape[0])
        offset += counts[-1]
        bases.append(rows_out)
        rows_out += len(req.streams)
    sampling = sampling_rows(requests, [len(r.streams) for r in requests], 0)
    inputs = StepInputs(
        kind="extend", input_ids=torch.tensor(ids, dtype=torch.int64),
        layout=StepLayout(torch.cat(positions), torch.cat(sids), torch.cat(rows)),
        qo_indptr=torch.tensor([0] + counts).cumsum(0),
        req_rows=torch.tensor([r.row for r in requests]),
        kv_start=torch.tensor([r.doc_len if cascade else 0 for r in requests]),
        prefix_lens=torch.tensor([r.doc_len for r in requests]),
        logit_indices=torch.cat(lasts), **doc_runs(requests, 0),
        cascade_groups=cascade_groups(requests, 0, lambda r: True) if cascade else None)
    fed = [np.arange(r.width) < len(r.streams) for r in requests]
    sampling.grammar = grammar_rows(requests, bases, fed)
    step = PlannedStep(uid, list(requests), inputs, sampling, bases, fed)
    for req, base in zip(requests, bases):
        req.start_answers()
        req.num_out[:len(req.streams)] += 1
        req.pending_step, req.pending_row = step.uid, base
    return step


def score_step(requests: Sequence[Request], cascade: bool = False
               ) -> tuple[StepInputs, ScoreLayout]:
    """One packed extend of scoring requests (runtime/scoring.py): each row holds its
    question and its choices after the document; cascade as in `prefill_step`."""
    if cascade:
        requests = sorted(requests, key=lambda r: r.doc.uid)
    plan = score_layout(requests)
    inputs = StepInputs(
        kind="extend", input_ids=plan.input_ids, layout=plan.layout,
        qo_indptr=torch.tensor([0] + plan.counts).cumsum(0),
        req_rows=torch.tensor([r.row for r in requests]),
        kv_start=torch.tensor([r.doc_len if cascade else 0 for r in requests]),
        prefix_lens=torch.tensor([r.doc_len for r in requests]),
        logit_indices=plan.logit_indices, **doc_runs(requests, 0),
        cascade_groups=cascade_groups(requests, 0, lambda r: True) if cascade else None)
    return inputs, plan


def decode_step(requests: Sequence[Request], uid: int, *, dummy_row: int, pad_to: int = 0,
                prev: PlannedStep | None = None) -> PlannedStep:
    """One token per schedulable stream of every request (one of `decode_batches`); logit
    rows = all B * P tokens. Parallel requests make an "extend" step; width-1 requests a
    "decode" step, with cascade groups when any of them decodes by cascade.

    pad_to > B appends dummy requests (`dummy_row`: sink slots only, nothing cached, every stream
    finished) so a step has a fixed shape for CUDA graphs; their logit rows are ignored.
    `prev`: the step still in flight; streams whose last token it sampled take their input
    from its device tokens (`StepInputs.input_src`) instead of the host.
    Building the step advances each request's row, positions and sampling counters.
    """
    batch, width = len(requests), requests[0].width
    kind = "extend" if requests[0].mode == "parallel" else "decode"
    modes = {r.mode for r in requests}
    cascade = kind == "decode" and "cascade" in modes
    mixed = cascade and len(modes) > 1
    pad = max(0, pad_to - batch)
    if width == 1:
        # Stock and cascade (hot at B=256): each request's state read once as scalars.
        fed1 = np.array([r.feeds_one() for r in requests] + [False] * pad)
        feed = list(fed1[:batch, None])  # [1] views, one per request
        counts = fed1[:batch].astype(np.int64).tolist()
        next_pos = torch.from_numpy(np.array([r.next_pos[0] for r in requests] + [0] * pad,
                                             dtype=np.int64)[:, None])
        live = torch.from_numpy(fed1[:, None])
        last_tokens = np.array([r.last_token[0] for r in requests] + [0] * pad, dtype=np.int64)
    else:
        feed = [r.schedulable() for r in requests]
        counts = [int(mask.sum()) for mask in feed]
        dummy = [np.zeros(width, dtype=np.int64)] * pad
        next_pos = torch.from_numpy(np.stack([r.next_pos for r in requests] + dummy))
        live = torch.from_numpy(np.stack(feed + [d.astype(bool) for d in dummy]))
        last_tokens = np.concatenate([r.last_token for r in requests] + dummy)
    for req, count in zip(requests, counts):
        if req.prefix_len + count > req.doc_len + req.slots.numel():  # the row's slots
            raise RuntimeError(f"request row {req.row} would outgrow its KV reservation")
    prefix = torch.tensor([r.prefix_len for r in requests] + [0] * pad)
    layout, _ = decode_layout(prefix, next_pos, live)
    tokens = (batch + pad) * width
    rows = [r.row for r in requests] + [dummy_row] * pad
    groups = None
    kv_start = torch.zeros(batch + pad, dtype=torch.int64)
    hints = doc_runs(requests, pad)
    if cascade:
        # Cascade requests read their rows after the document; stock ones read them whole,
        # with the document hints that only they keep.
        groups = cascade_groups(requests, pad, lambda r: r.mode == "cascade")
        kv_start = torch.tensor([r.doc_len if r.mode == "cascade" else 0 for r in requests]
                                + [0] * pad)
        if mixed:
            keep = torch.tensor([r.mode != "cascade" for r in requests] + [False] * pad)
            hints = {k: v * keep for k, v in hints.items()}
        else:
            hints = {}
    input_src = None
    if prev is not None and any(r.pending_step == prev.uid for r in requests):
        if width == 1:
            input_src = torch.tensor([r.pending_row if r.pending_step == prev.uid else -1
                                      for r in requests] + [-1] * pad)
        else:
            lanes, none = np.arange(width), np.full(width, -1)
            input_src = torch.from_numpy(np.concatenate(
                [np.where(lanes < len(r.streams), r.pending_row + lanes, -1)
                 if r.pending_step == prev.uid else none for r in requests] + [none] * pad))
    inputs = StepInputs(
        kind=kind, input_ids=torch.from_numpy(last_tokens),
        layout=layout, qo_indptr=torch.arange(0, tokens + 1, width),
        req_rows=torch.tensor(rows), kv_start=kv_start, prefix_lens=prefix,
        logit_indices=torch.arange(tokens), cascade_groups=groups, decode=True,
        input_src=input_src, **hints)
    sampling = sampling_rows(requests, None, pad * width)
    bases = list(range(0, batch * width, width))
    sampling.grammar = grammar_rows(requests, bases, feed)
    step = PlannedStep(uid, list(requests), inputs, sampling, bases, feed)
    if width == 1:
        for req, count, base in zip(requests, counts, step.bases):
            if count:
                req.prefix_len += 1
                req.next_pos[0] += 1
                req.num_out[0] += 1
            req.pending_step, req.pending_row = step.uid, base
        return step
    for req, mask, count, base in zip(requests, feed, counts, step.bases):
        req.prefix_len += count
        req.next_pos += mask
        req.num_out += mask
        req.pending_step, req.pending_row = step.uid, base
    return step
