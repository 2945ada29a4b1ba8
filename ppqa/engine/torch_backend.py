"""The reference attention backend: plain torch, runs anywhere, the truth the Triton kernels match.

Per step, `init_forward_metadata` (called by the runner once, after it has set `slot_sid` for the
step's new slots) turns the `ForwardMetadata` into a plan that every layer reuses:
  - extend: per request, the stage-1 slots req_to_token[row, kv_start:prefix_len] and the dense
    mask of the stream rule over [stage-1 keys | the step's new keys] (`layout.extend_mask`);
  - decode: one padded [B, L] slot matrix of each row [kv_start, prefix_len + 1) and its validity;
  - cascade decode: per group of requests sharing a document, the document's slots; per request,
    the suffix slots [doc_len, prefix_len + 1). The document part is one matrix-matrix product of
    the group's queries with the document's keys, the suffix part is per request, and the two are
    merged by log-sum-exp (`merge_partials`), literally as a cascade kernel would.
Softmax is computed in float32 whatever the model dtype. Each layer's `forward` first writes the
step's K/V into the pool at `out_slots`.
"""

from __future__ import annotations

import torch

from ppqa.engine.attention import ForwardMetadata
from ppqa.engine.kv_cache import KVPool
from ppqa.engine.layout import extend_mask

# Upper bound on the elements of one float32 score tensor; larger work is chunked.
MAX_SCORE_ELEMENTS = 1 << 25


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with its log-sum-exp, in float32.

    q [B, n, H, D], k/v [B, m, KVH, D], mask [B, n, m] bool -> out [B, n, H, D] (float32),
    lse [B, n, H] (natural log; -inf for a query that sees no key, whose output is 0).
    """
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qf = q.float().reshape(batch, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, KVH, G, n, m]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = (probs @ vf).permute(0, 3, 1, 2, 4).reshape(batch, n, heads, dim)
    return out, lse.permute(0, 3, 1, 2).reshape(batch, n, heads)


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets: out [..., D], lse [...]."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    w1, w2 = torch.exp(lse1 - safe).unsqueeze(-1), torch.exp(lse2 - safe).unsqueeze(-1)
    return out1 * w1 + out2 * w2, lse


def _padded_rows(table: torch.Tensor, rows: list[int], starts: list[int],
                 ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] slot ids of table[rows[b], starts[b]:ends[b]] padded with slot 0, and validity."""
    width = max([e - s for s, e in zip(starts, ends)] + [1])
    device = table.device
    offsets = torch.arange(width, device=device).view(1, -1)
    start_t = torch.tensor(starts, device=device).view(-1, 1)
    lens_t = torch.tensor([e - s for s, e in zip(starts, ends)], device=device).view(-1, 1)
    valid = offsets < lens_t
    cols = (start_t + offsets).clamp(max=table.shape[1] - 1)
    slots = table[torch.tensor(rows, device=device)].gather(1, cols).long()
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


class TorchBackend:
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 sm_scale: float) -> None:
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        self._meta: ForwardMetadata | None = None
        self._plan: dict = {}

    # ---- per-step plan ---------------------------------------------------------------------

    def init_forward_metadata(self, meta: ForwardMetadata) -> None:
        rows = meta.req_indices.tolist()
        kv_start, prefix = meta.kv_start.tolist(), meta.prefix_lens.tolist()
        table = meta.req_to_token
        if meta.kind == "extend":
            indptr = meta.qo_indptr.tolist()
            plan = []
            for b, row in enumerate(rows):
                slots = table[row, kv_start[b]:prefix[b]].long()
                mask = extend_mask(self.pool.slot_sid[slots], meta.q_sid[indptr[b]:indptr[b + 1]])
                plan.append((indptr[b], indptr[b + 1], slots, mask))
            self._plan = {"extend": plan}
        elif meta.cascade is None:
            ends = [p + 1 for p in prefix]
            self._plan = {"decode": _padded_rows(table, rows, kv_start, ends)}
        else:
            casc = meta.cascade
            groups = []
            for g, (a, b) in enumerate(zip(casc.group_req_indptr.tolist()[:-1],
                                           casc.group_req_indptr.tolist()[1:])):
                doc_row, doc_len = int(casc.doc_req_indices[g]), int(casc.doc_lens[g])
                groups.append((a, b, table[doc_row, :doc_len].long()))
            ends = [p + 1 for p in prefix]
            self._plan = {"groups": groups, "suffix": _padded_rows(table, rows, kv_start, ends)}
        self._meta = meta

    # ---- attention -------------------------------------------------------------------------

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: ForwardMetadata) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        k_buf[meta.out_slots] = k.to(k_buf.dtype)
        v_buf[meta.out_slots] = v.to(v_buf.dtype)
        if self._meta is not meta:
            self.init_forward_metadata(meta)
        if meta.kind == "extend":
            out = self._extend(q, k, v, k_buf, v_buf)
        elif meta.cascade is None:
            out = self._decode(q, k_buf, v_buf)
        else:
            out = self._cascade(q, k_buf, v_buf)
        return out.to(q.dtype)

    def _extend(self, q, k, v, k_buf, v_buf) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for start, end, slots, mask in self._plan["extend"]:
            keys = torch.cat([k_buf[slots], k[start:end].to(k_buf.dtype)]).unsqueeze(0)
            values = torch.cat([v_buf[slots], v[start:end].to(v_buf.dtype)]).unsqueeze(0)
            # Chunk the queries so the score tensor stays bounded for long prefills.
            step = max(1, MAX_SCORE_ELEMENTS // max(1, keys.shape[1] * self.num_heads))
            for c in range(start, end, step):
                c_end = min(end, c + step)
                rows = mask[c - start:c_end - start].unsqueeze(0)
                out[c:c_end] = attend(q[c:c_end].unsqueeze(0), keys, values, rows, self.sm_scale)[0][0]
        return out

    def _padded_attend(self, q, k_buf, v_buf, slots, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per request over its padded slots: out [B, H, D], lse [B, H]."""
        batch, width = slots.shape
        step = max(1, MAX_SCORE_ELEMENTS // max(1, width * self.num_heads))
        outs, lses = [], []
        for a in range(0, batch, step):
            b = min(batch, a + step)
            o, lse = attend(q[a:b].unsqueeze(1), k_buf[slots[a:b]], v_buf[slots[a:b]],
                            valid[a:b].unsqueeze(1), self.sm_scale)
            outs.append(o[:, 0])
            lses.append(lse[:, 0])
        return torch.cat(outs), torch.cat(lses)

    def _decode(self, q, k_buf, v_buf) -> torch.Tensor:
        slots, valid = self._plan["decode"]
        return self._padded_attend(q, k_buf, v_buf, slots, valid)[0]

    def _cascade(self, q, k_buf, v_buf) -> torch.Tensor:
        slots, valid = self._plan["suffix"]
        out, lse = self._padded_attend(q, k_buf, v_buf, slots, valid)
        for a, b, doc_slots in self._plan["groups"]:
            if doc_slots.numel() == 0:
                continue
            # The group's queries form one [n_g, H, D] block against the document's keys, read once.
            group_q = q[a:b].unsqueeze(0)
            doc_mask = torch.ones(1, b - a, doc_slots.numel(), dtype=torch.bool, device=q.device)
            doc_out, doc_lse = attend(group_q, k_buf[doc_slots].unsqueeze(0),
                                      v_buf[doc_slots].unsqueeze(0), doc_mask, self.sm_scale)
            out[a:b], lse[a:b] = merge_partials(doc_out[0], doc_lse[0], out[a:b], lse[a:b])
        return out
