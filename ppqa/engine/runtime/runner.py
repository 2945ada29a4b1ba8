"""The model runner: a step's host inputs in, logits out; the only place a step touches the device.

The scheduler describes a step as `StepInputs` (CPU tensors, built with batched torch ops from the
stream layout). `ModelRunner.prepare` packs every integer input into one tensor, moves it to the
device in one copy, looks the new tokens' slots up in req_to_token on the device
(row position -1 -> sink slot 0), sets `pool.slot_sid[out_slots] = q_sid`, and builds the
`ForwardMetadata` that every layer's attention receives. `run` then calls the model and returns
float32 logits for `logit_indices` only.

A step may carry a `lead`: a document's last prefill chunk run in the same forward, its rows
first (`SplitAttention`). The projections then run over both at once, so a question prefill of a
few hundred rows does not read the weights in a forward of its own; each part's attention runs
over its own rows with its own metadata.

A decode step's shapes depend only on (B, P): `GraphCache` (graph_runner.py) copies `prepare`'s
outputs into a captured graph's static tensors and replays it. A decode step's input tokens may
come from the previous step's sampled tokens, still on the device (`StepInputs.input_src`), so the
engine can build and launch step t+1 before reading step t back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.layout import StepLayout
from ppqa.engine.model.llama import LlamaModel


@dataclass
class StepInputs:
    """One forward step, on the host. B requests, T new tokens, R logit rows."""

    kind: Literal["extend", "decode"]
    input_ids: torch.Tensor  # [T] int64
    layout: StepLayout  # positions, q_sid, row_pos per new token
    qo_indptr: torch.Tensor  # [B+1] int64
    req_rows: torch.Tensor  # [B] int64 rows in req_to_token
    kv_start: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    logit_indices: torch.Tensor  # [R] int64
    # (first request, end, doc_len, first slot of the document's run or -1)
    cascade_groups: list[tuple[int, int, int, int]] | None = None
    decode: bool = False  # a decode step (fixed shape per batch): replayed as a CUDA graph
    # [T] int64: row of the previous step's sampled tokens (on the device) that is this token's
    # input, or -1 to take input_ids; None: every input from input_ids.
    input_src: torch.Tensor | None = None
    doc_start: torch.Tensor | None = None  # [B] int64, see ForwardMetadata
    doc_len: torch.Tensor | None = None  # [B] int64
    # One request whose new tokens are all document tokens with nothing cached before them:
    # attention is plain causal over the step's own tokens (ForwardMetadata.plain_causal).
    plain_causal: bool = False
    # A later chunk of a document held in one slot run: (first slot, tokens before the chunk)
    # (ForwardMetadata.doc_prior).
    doc_prior: tuple[int, int] | None = None
    # A document chunk (no logit rows) run in this step's forward, its tokens before this
    # step's (`ModelRunner.run`); its rows count in neither this step's layout nor its indices.
    lead: StepInputs | None = None

    def __post_init__(self) -> None:
        tokens, batch = self.input_ids.shape[0], self.req_rows.shape[0]
        if self.kind not in ("extend", "decode"):
            raise ValueError(f"StepInputs.kind must be 'extend' or 'decode', got {self.kind!r}")
        if self.layout.positions.shape[0] != tokens or self.layout.row_pos.shape[0] != tokens:
            raise ValueError(f"StepInputs: {tokens} tokens but a layout of "
                             f"{self.layout.positions.shape[0]} positions")
        if self.qo_indptr.shape[0] != batch + 1 or int(self.qo_indptr[-1]) != tokens:
            raise ValueError(f"StepInputs.qo_indptr must have {batch + 1} entries ending at {tokens}")
        if self.kind == "decode" and tokens != batch:
            raise ValueError(f"a decode step has one token per request: {tokens} tokens, {batch} requests")
        if self.lead is not None and (self.decode or self.lead.lead is not None
                                      or self.lead.logit_indices.numel()):
            raise ValueError("StepInputs.lead is one chunk without logit rows, before a step "
                             "that is not a graphed decode step")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, table: ReqToTokenTable, backend,
                 device: torch.device, cuda_graphs: bool = False) -> None:
        self.model, self.pool, self.table, self.backend = model, pool, table, backend
        self.device = device
        self.graphs = None
        if cuda_graphs:
            from ppqa.engine.runtime.graph_runner import GraphCache

            self.graphs = GraphCache(model, backend, device)

    def prepare(self, step: StepInputs, prev_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ForwardMetadata]:
        """(input_ids on the device, ForwardMetadata); also stamps slot_sid for the new slots.
        prev_tokens: the previous step's sampled tokens, which step.input_src points into."""
        batch = step.req_rows.shape[0]
        token_req = torch.repeat_interleave(torch.arange(batch), step.qo_indptr.diff())
        parts = [step.input_ids, step.layout.positions, step.layout.q_sid.to(torch.int64),
                 step.layout.row_pos, token_req, step.req_rows, step.kv_start, step.prefix_lens,
                 step.qo_indptr, step.logit_indices]
        optional = [t for t in (step.input_src, step.doc_start, step.doc_len) if t is not None]
        parts += optional
        groups = step.cascade_groups
        if groups is not None:
            # A group's batch rows: its requests (decode: one token each) or their tokens (extend).
            ends = torch.tensor([0] + [g[1] for g in groups])
            group_rows = ends if step.kind == "decode" else step.qo_indptr[ends]
            parts += [group_rows, step.req_rows[[g[0] for g in groups]],
                      torch.tensor([g[2] for g in groups]),
                      torch.tensor([max(g[3], 0) for g in groups])]
        sizes = [p.shape[0] for p in parts]
        packed = torch.cat([p.to(torch.int64) for p in parts])
        if self.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        (input_ids, positions, q_sid, row_pos, token_req_d, req_rows, kv_start, prefix_lens,
         qo_indptr, logit_indices, *rest) = packed.split(sizes)
        extras = iter(rest)
        if step.input_src is not None:
            if prev_tokens is None:
                raise ValueError("StepInputs.input_src needs the previous step's tokens")
            src = next(extras)
            input_ids = torch.where(src >= 0, prev_tokens[src.clamp(min=0)], input_ids)
        doc_start = next(extras).to(torch.int32) if step.doc_start is not None else None
        doc_len = next(extras).to(torch.int32) if step.doc_len is not None else None
        cascade = list(extras)
        table = self.table.table
        rows_of_tokens = req_rows[token_req_d]
        out_slots = torch.where(row_pos >= 0, table[rows_of_tokens, row_pos.clamp(min=0)].long(),
                                torch.zeros_like(row_pos))
        q_sid = q_sid.to(torch.int32)
        self.pool.slot_sid[out_slots] = q_sid
        cascade_meta = None
        if groups is not None:
            indptr, doc_rows, doc_lens, doc_starts = cascade
            cascade_meta = CascadeMetadata(
                group_req_indptr=indptr.to(torch.int32), doc_req_indices=doc_rows.to(torch.int32),
                doc_lens=doc_lens.to(torch.int32),
                max_group_size=int(group_rows.diff().max()),
                max_doc_len=max(g[2] for g in groups),
                doc_starts=doc_starts.to(torch.int32),
                contiguous=all(g[3] >= 0 or g[2] == 0 for g in groups),
                doc_groups=sum(1 for g in groups if g[2] > 0))
        extend_lens = step.qo_indptr.diff()
        meta = ForwardMetadata(
            kind=step.kind, positions=positions, out_slots=out_slots, q_sid=q_sid,
            qo_indptr=qo_indptr.to(torch.int32), req_indices=req_rows.to(torch.int32),
            kv_start=kv_start.to(torch.int32), prefix_lens=prefix_lens.to(torch.int32),
            req_to_token=table, logit_indices=logit_indices,
            max_extend_len=int(extend_lens.max()) if batch else 0,
            max_prefix_len=int(step.prefix_lens.max()) if batch else 0,
            cascade=cascade_meta, doc_start=doc_start, doc_len=doc_len,
            host_prefix_lens=step.prefix_lens, plain_causal=step.plain_causal,
            doc_prior=step.doc_prior)
        init = getattr(self.backend, "init_forward_metadata", None)
        if init is not None:
            init(meta)
        return input_ids, meta

    @torch.inference_mode()
    def run(self, step: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward one step; float32 logits [R, vocab] for the step's logit rows (None if R = 0).
        Nothing here waits for the device."""
        if step.lead is not None:
            return self._run_with_lead(step, prev_tokens)
        input_ids, meta = self.prepare(step, prev_tokens)
        if self.graphs is not None and step.decode:
            logits = self.graphs.run(input_ids, meta)
            if logits is not None:
                return logits
        hidden = self.model(input_ids, meta.positions, meta, self.backend)
        if meta.logit_indices.shape[0] == 0:
            return None
        return self.model.compute_logits(hidden[meta.logit_indices])

    def _run_with_lead(self, step: StepInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """`run` for a step with a lead chunk: both prepared (the lead first, so that its slots'
        stream ids are stamped before the step plans over them), one forward over their rows."""
        lead_ids, lead_meta = self.prepare(step.lead)
        input_ids, meta = self.prepare(step, prev_tokens)
        rows = lead_ids.shape[0]
        split = SplitAttention(self.backend, [(0, rows, lead_meta),
                                              (rows, rows + input_ids.shape[0], meta)])
        hidden = self.model(torch.cat([lead_ids, input_ids]),
                            torch.cat([lead_meta.positions, meta.positions]), meta, split)
        if meta.logit_indices.shape[0] == 0:
            return None
        return self.model.compute_logits(hidden[meta.logit_indices + rows])


class SplitAttention:
    """The attention of one forward whose rows are several steps' (`StepInputs.lead`): each
    part's K/V written and its attention computed by `backend` over its own rows, with its own
    metadata (the `meta` the layers pass is ignored). The parts run in order within a layer,
    so a later part may read what an earlier one wrote there (questions after their document's
    last chunk)."""

    def __init__(self, backend, parts: list[tuple[int, int, ForwardMetadata]]) -> None:
        self.backend, self.parts = backend, parts

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: ForwardMetadata) -> torch.Tensor:
        return torch.cat([self.backend.forward(layer, q[a:b], k[a:b], v[a:b], part)
                          for a, b, part in self.parts])
