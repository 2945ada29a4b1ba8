"""The reference attention backend: plain torch, runs anywhere, the truth the Triton kernels match.

Per step, `init_forward_metadata` (called by the runner once, after it has set `slot_sid` for the
step's new slots) turns the `ForwardMetadata` into a plan that every layer reuses:
  - extend: per request, the stage-1 slots req_to_token[row, kv_start:prefix_len] and the dense
    mask of the stream rule over [stage-1 keys | the step's new keys] (`layout.extend_mask`);
    attention is torch's scaled_dot_product_attention under that mask;
  - decode: per request, its row [kv_start, prefix_len + 1) in runs of consecutive slots, read
    in place from the pool (views, no gathered copy: each request reads its document's KV once per
    step, as a paged decode kernel does);
  - cascade decode: per group of requests sharing a document, the document's slot runs; per
    request, its suffix runs [doc_len, prefix_len + 1). The document part is one matrix-matrix
    product of the group's queries with the document's keys, the suffix part is per request, and
    the two are merged by log-sum-exp (`merge_two_states`), literally as a cascade kernel would;
  - cascade extend (question prefill): the same split, the group's rows being question tokens
    and the per-request part the masked extend from kv_start = doc_len.
Scores and softmax are computed in float32 whatever the model dtype. Each layer's `forward` first
writes the step's K/V into the pool at `out_slots`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ppqa.engine.attention.metadata import ForwardMetadata, RecentPlans
from ppqa.engine.runtime.kv_cache import KVPool
from ppqa.engine.runtime.layout import extend_mask

Runs = list[tuple[int, int]]  # [start, end) ranges of consecutive pool slots


def slot_runs(slots: torch.Tensor) -> Runs:
    """Split a row's slot ids into ranges of consecutive slots (one range if allocated contiguously)."""
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, slots.numel()]
    starts = slots[bounds[:-1]].tolist()
    return [(s, s + (b - a)) for s, a, b in zip(starts, bounds[:-1], bounds[1:])]


def attend_runs(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, runs: Runs,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q [n, H, D] over the keys in `runs` of the pool (unmasked), read in place.

    Returns out [n, H, D] (float32) and lse [n, H] (natural log; -inf and out 0 for no keys).
    """
    n, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    if not runs:
        return (torch.zeros(n, heads, dim, dtype=torch.float32, device=q.device),
                torch.full((n, heads), float("-inf"), device=q.device))
    group = heads // kv_heads
    # [KVH, G * n, D]: plain batched matmuls against [KVH, D, L] views of the pool (no broadcast,
    # so BLAS reads the strided pool in place instead of materializing a copy).
    qf = q.float().reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    scores = torch.cat([torch.bmm(qf, k_buf[a:b].float().permute(1, 2, 0)) for a, b in runs],
                       dim=-1) * scale  # [KVH, G * n, L]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out, offset = None, 0
    for a, b in runs:
        part = torch.bmm(probs[..., offset:offset + b - a], v_buf[a:b].float().permute(1, 0, 2))
        out = part if out is None else out + part
        offset += b - a
    out = out.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)
    return out, lse.reshape(kv_heads, group, n).permute(2, 0, 1).reshape(n, heads)


def attend_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] over keys/values [m, KVH, D] under mask [n, m]: (out [n, H, D] float32,
    lse [n, H]; -inf and out 0 for a row that sees no key)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    kf = keys.float().repeat_interleave(heads // kv_heads, dim=1)  # [m, H, D]
    vf = values.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = torch.einsum("hnm,mhd->nhd", probs, vf)
    return out, lse.transpose(0, 1)


def merge_two_states(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets: out [..., D], lse [...]."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    w1, w2 = torch.exp(lse1 - safe).unsqueeze(-1), torch.exp(lse2 - safe).unsqueeze(-1)
    return out1 * w1 + out2 * w2, lse


class TorchBackend:
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 sm_scale: float) -> None:
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        self._meta: ForwardMetadata | None = None
        self._plan: dict = {}
        self._recent = RecentPlans()  # a forward of two parts meets two metadata a layer

    # ---- per-step plan ---------------------------------------------------------------------

    def init_forward_metadata(self, meta: ForwardMetadata) -> None:
        rows = meta.req_indices.tolist()
        kv_start, prefix = meta.kv_start.tolist(), meta.prefix_lens.tolist()
        table = meta.req_to_token
        groups = []  # cascade: (first batch row, end, the document's slot runs) per group
        if meta.cascade is not None:
            casc = meta.cascade
            group_rows = casc.group_req_indptr.tolist()
            for g, doc_row in enumerate(casc.doc_req_indices.tolist()):
                doc_len = int(casc.doc_lens[g])
                groups.append((group_rows[g], group_rows[g + 1],
                               slot_runs(table[doc_row, :doc_len])))
        if meta.kind == "extend":
            indptr = meta.qo_indptr.tolist()
            plan = []
            for b, row in enumerate(rows):
                slots = table[row, kv_start[b]:prefix[b]].long()
                mask = extend_mask(self.pool.slot_sid[slots], meta.q_sid[indptr[b]:indptr[b + 1]])
                plan.append((indptr[b], indptr[b + 1], slot_runs(slots), mask))
            self._plan = {"extend": plan, "groups": groups}
        else:
            # Decode: the new token's slot is already in the row at prefix_len (written first).
            runs = [slot_runs(table[row, kv_start[b]:prefix[b] + 1]) for b, row in enumerate(rows)]
            self._plan = {"runs": runs, "groups": groups}
        self._meta = meta
        self._recent.keep(meta, self._plan)

    # ---- attention -------------------------------------------------------------------------

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: ForwardMetadata) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        k_buf[meta.out_slots] = k.to(k_buf.dtype)
        v_buf[meta.out_slots] = v.to(v_buf.dtype)
        if self._meta is not meta:
            plan = self._recent.get(meta)
            if plan is None:
                self.init_forward_metadata(meta)
            else:
                self._meta, self._plan = meta, plan
        if meta.kind == "extend":
            out = self._extend(q, k, v, k_buf, v_buf)
        else:
            out = self._decode(q, k_buf, v_buf)
        return out.to(q.dtype)

    def _extend(self, q, k, v, k_buf, v_buf) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        groups = self._plan["groups"]
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if groups else None
        for start, end, runs, mask in self._plan["extend"]:
            # Runs of consecutive slots copy as blocks, far faster than a per-slot gather.
            keys = torch.cat([k_buf[a:b] for a, b in runs] + [k[start:end].to(k_buf.dtype)]).float()
            values = torch.cat([v_buf[a:b] for a, b in runs] + [v[start:end].to(v_buf.dtype)]).float()
            if lse is not None:
                out[start:end], lse[start:end] = attend_masked(q[start:end], keys, values, mask,
                                                               self.sm_scale)
                continue
            # [1, heads, tokens, dim] layout; GQA heads share their KV head inside SDPA.
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].float().transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=mask.unsqueeze(0).unsqueeze(0),
                scale=self.sm_scale, enable_gqa=True)[0].transpose(0, 1)
        for a, b, doc_runs in groups:
            # Cascade prefill: every question token of the group against the document at once.
            doc_out, doc_lse = attend_runs(q[a:b], k_buf, v_buf, doc_runs, self.sm_scale)
            out[a:b], lse[a:b] = merge_two_states(doc_out, doc_lse, out[a:b], lse[a:b])
        return out

    def _decode(self, q, k_buf, v_buf) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for b, runs in enumerate(self._plan["runs"]):
            out[b:b + 1], lse[b:b + 1] = attend_runs(q[b:b + 1], k_buf, v_buf, runs, self.sm_scale)
        for a, b, doc_runs in self._plan["groups"]:
            # Cascade: the group's queries form one [n_g, H, D] block against the document's keys,
            # read once for the whole group, then merged with each request's own part.
            doc_out, doc_lse = attend_runs(q[a:b], k_buf, v_buf, doc_runs, self.sm_scale)
            out[a:b], lse[a:b] = merge_two_states(doc_out, doc_lse, out[a:b], lse[a:b])
        return out
