"""The attention seam: per-step metadata and the backend interface.

The runner builds one `ForwardMetadata` per forward step from the scheduler's batch and hands it,
unchanged, to every layer's attention call. A backend (`TorchBackend` in `torch_backend.py`, runs
anywhere; `TritonBackend` in `triton_backend.py`, GPU) writes the step's new K/V into the pool
and computes attention under the stream rule:

    query t (stream q_sid[t]) may attend key k  iff  causal(t, k) and
        (sid_k == -1 or sid_k == q_sid[t])

Keys come from two places (the "stages" of the extend kernel):
  stage 1: request b's cached row  req_to_token[req_indices[b], kv_start[b] : prefix_lens[b]],
           whose stream ids are pool.slot_sid[slot]; every cached key is causally earlier;
  stage 2: the step's own new tokens of request b (rows qo_indptr[b] : qo_indptr[b+1] of k/v),
           whose stream ids are q_sid; new token j is causally before new token i iff j <= i.

Kinds of step:
  "extend": any number of new tokens per request (document prefill, question prefill, and every
            `parallel` decode step, which is P new tokens per request); both stages.
  "decode": exactly one new token per request, no stream rule (stock / cascade decode). The new
            token's slot is already in its row at position prefix_lens[b], so a decode kernel may
            read the row [kv_start, prefix_lens + 1) after the K/V write.
  A `cascade` decode step also carries `CascadeMetadata`: the document part of attention is
  computed once per group of requests sharing a document, the per-request part over
  row[kv_start : prefix_lens + 1] (kv_start = document length), and the two merged by
  log-sum-exp. A `cascade` question prefill is an extend step with `CascadeMetadata` whose
  groups count tokens: every question token of a group meets the document in one tiled
  product, and stages 1-2 run from kv_start = document length.

The KV pool (`runtime/kv_cache.py`, class `KVPool`) exposes `k_buffers[layer]` and
`v_buffers[layer]` ([num_slots, num_kv_heads, head_dim], slot 0 a sink for padding) and `slot_sid`
([num_slots] int32).
The runner sets `slot_sid[out_slots] = q_sid` once per step, before the forward; a backend writes
only K/V. A backend is built as `Backend(pool, num_heads, num_kv_heads, head_dim, sm_scale)`.

All index tensors live on the model's device. Shapes depend only on the batch (B requests,
T new tokens), never on how much has been generated, so a decode step can be captured as a
CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch


@dataclass
class CascadeMetadata:
    """Groups of decode requests that share a document (requests sorted so groups are contiguous)."""

    # [G+1] int32: group g's queries are batch rows [indptr[g], indptr[g+1]): its requests in a
    # decode step, its requests' tokens in an extend step (cascade question prefill)
    group_req_indptr: torch.Tensor
    doc_req_indices: torch.Tensor  # [G] int32: a req_to_token row holding the group's document
    doc_lens: torch.Tensor  # [G] int32: document tokens (the row prefix [0, doc_len) is the document)
    max_group_size: int  # rows
    max_doc_len: int
    # [G] int32: group g's document is the slot run doc_starts[g] + i; meaningful when
    # `contiguous` (host bool: every group's document is one run), else kernels gather.
    doc_starts: torch.Tensor | None = None
    contiguous: bool = False
    # host int: the groups that have a document (a batch padded for a CUDA graph ends in a
    # group of dummies whose document is empty); the split planner counts only these. None: G.
    doc_groups: int | None = None


@dataclass
class ForwardMetadata:
    kind: Literal["extend", "decode"]
    positions: torch.Tensor  # [T] int64 rotary position of each new token
    out_slots: torch.Tensor  # [T] int64 pool slot receiving each new token's K/V (0 = sink)
    q_sid: torch.Tensor  # [T] int32 stream id of each new token (-1: document token)
    qo_indptr: torch.Tensor  # [B+1] int32 new tokens of request b: rows [qo_indptr[b], qo_indptr[b+1])
    req_indices: torch.Tensor  # [B] int32 row of each request in req_to_token
    kv_start: torch.Tensor  # [B] int32 first row position read in stage 1 (0, or doc len for cascade)
    prefix_lens: torch.Tensor  # [B] int32 row positions cached before this step
    req_to_token: torch.Tensor  # [max_reqs, max_row_len] int32 slots of each row
    logit_indices: torch.Tensor  # [R] int64 rows of the step whose logits are needed
    max_extend_len: int  # max new tokens of one request in this step
    max_prefix_len: int  # max prefix_lens over the batch (host int; may be an upper bound)
    cascade: CascadeMetadata | None = None
    # Optional hints, [B] int32: row positions [0, doc_len[b]) of request b are the slot run
    # doc_start[b] + i, all of stream -1 (a cached document); doc_len 0 = unknown. Kernels may
    # read that part with affine addresses; without them (None) they gather everything.
    doc_start: torch.Tensor | None = None
    doc_len: torch.Tensor | None = None
    # [B] int64 on the host: prefix_lens as the scheduler built them, for a backend that plans
    # on the host (FlashInfer); kernels read the device tensors.
    host_prefix_lens: torch.Tensor | None = None
    # Host bool: one request, every new token a document token (stream -1), nothing cached
    # before them (a document's first prefill chunk). The stream rule is then plain causal
    # attention over the step's tokens, which a backend may hand to a fused causal kernel.
    plain_causal: bool = False
    # Host (first slot, P): one request, every new token a document token, and the P document
    # tokens before them are the slot run first slot + i (a later prefill chunk of a document
    # held in one run). Attention is then the chunk against those P keys, every one visible,
    # merged with plain causal attention over the chunk's own tokens.
    doc_prior: tuple[int, int] | None = None

    @property
    def batch_size(self) -> int:
        return self.req_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class RecentPlans:
    """A backend's plans for the last few metadata it planned, by identity: a forward whose
    rows are two steps' (`runtime/runner.SplitAttention`) alternates between two metadata in
    every layer, and each is planned once."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._items: list[tuple[ForwardMetadata, object]] = []

    def keep(self, meta: ForwardMetadata, plan) -> None:
        others = [item for item in self._items if item[0] is not meta]
        self._items = [(meta, plan)] + others[:self.size - 1]

    def get(self, meta: ForwardMetadata):
        """The plan kept for `meta`, or None."""
        for kept, plan in self._items:
            if kept is meta:
                return plan
        return None


class AttentionBackend(Protocol):
    """What the model's attention layers call. One instance per engine, bound to its KV pool."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        meta: ForwardMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into the pool at meta.out_slots (layer `layer`), then attend."""
        ...
