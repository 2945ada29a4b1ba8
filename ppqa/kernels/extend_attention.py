"""Stream-masked extend attention: new tokens of a batch of requests against (stage 1) their
cached row in the KV pool and (stage 2) the step's own new tokens.

The mask is never materialised: for query token t (stream q_sid[t]) and key k (stream sid_k),
visible = causal(t, k) and (sid_k == -1 or sid_k == q_sid[t]). Stage 1 reads the row
req_to_token[req, kv_start:prefix_len] (every cached key is causally earlier) with sid_k from
slot_sid; stage 2 reads k_new/v_new rows of the request with sid_k from q_sid and j <= i.

Grid: (request, kv head x query tile, split). A query tile holds the query heads of one KV head
for a run of tokens (rows = tokens x group), so GQA loads each KV tile once. Keys that no row of
the tile may see are not loaded (masked loads), which skips hidden tiles without a branch and
keeps the loop pipelinable. When the grid is too small to fill the GPU (decode steps: few
requests, P tokens each), stage 1 is cut into splits along the row (flash-decoding); each split
writes a partial state and `merge_partials` combines them. The last split also runs stage 2.
Every grid dimension depends only on (B, heads, max tiles, splits); real lengths come from tensors.

Contiguous documents (doc_start/doc_len given): a request's document usually sits in one run of
slots (the allocator is first-fit over runs) and every document slot has sid -1. Stage 1 then
reads row positions [0, doc_len) as slots doc_start + i, with no req_to_token or slot_sid load:
addresses affine in the loop index, which Triton's pipeliner turns into async copies (on sm_90,
whole tiles through tensor descriptors: `_tile.tma_tiles`); only the rest of the row (the
questions and answers) goes through the gather loop.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys
from ppqa.kernels._ref import masked_attention_ref
from ppqa.kernels._tile import (
    NEG_BIG, doc_run, softmax_update, tile_scores, tma_tiles, write_rows,
)
from ppqa.kernels.merge import (
    PartialScratch, lse_strides, merge_partials, partial_buffers, partial_strides,
)


@triton.jit
def _load_kv(K_pool, V_pool, slots, c_ok, kv_head_off, d, d_ok, stride_pool_s,
             DOT_DT: tl.constexpr):
    """One key tile: K transposed ([D, N], so it feeds tl.dot without a layout change), V [N, D]."""
    k_t = tl.load(K_pool + slots[None, :] * stride_pool_s + kv_head_off + d[:, None],
                  mask=c_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DT)
    v = tl.load(V_pool + slots[:, None] * stride_pool_s + kv_head_off + d[None, :],
                mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)
    return k_t, v


# Counts and offsets that change from step to step, and the partial lse strides (they follow
# the state count), are not specialised on (== 1, a multiple of 16): each such class of values
# would be one more variant to compile.
@triton.jit(do_not_specialize=["num_m_tiles", "state_offset", "num_splits", "stride_plt",
                               "stride_plh"])
def _extend_kernel(
    Q, K_new, V_new, O, Lse, Part_o, Part_lse,
    K_pool, V_pool, K_desc, V_desc, Req_to_token, Req_idx, Kv_start, Prefix_lens, Qo_indptr,
    Q_sid, Slot_sid, Doc_start, Doc_len,
    scale_log2, num_m_tiles, state_offset, num_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
    stride_pool_s, stride_pool_h, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_DOC: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // num_m_tiles
    m_tile = tl.program_id(1) % num_m_tiles
    split = tl.program_id(2)
    TOKS: tl.constexpr = BLOCK_M // GROUP  # tokens per query tile

    q_start = tl.load(Qo_indptr + b)
    q_len = tl.load(Qo_indptr + b + 1) - q_start
    tok0 = m_tile * TOKS
    live = tok0 < q_len  # tiles past this request's tokens run empty loops and store nothing

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < TOKS * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t_idx = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(DOT_DT)
    q_sid = tl.load(Q_sid + t_idx, mask=row_ok, other=-3)  # -3 matches no key

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Stage 1: this split's piece of the cached row.
    req = tl.load(Req_idx + b).to(tl.int64)
    kv0 = tl.load(Kv_start + b)
    kv1 = tl.load(Prefix_lens + b)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv1 - kv0, 0), num_splits), BLOCK_N) * BLOCK_N
    lo = kv0 + split * chunk
    hi = tl.minimum(lo + chunk, kv1)
    hi = tl.where(live, hi, lo)
    kv_head_off = kvh * stride_pool_h
    gather_lo = lo
    if HAS_DOC:
        # The document piece [lo, min(hi, doc_len)): slots doc_start + i, every key visible.
        doc_hi, doc_slot0 = doc_run(Doc_start, Doc_len, b, hi, IDX64)
        tail, m_i, l_i, acc = tma_tiles(q, K_desc, V_desc, doc_slot0, lo, doc_hi,
                                        (kvh * HEAD_DIM).to(tl.int32), scale_log2, m_i, l_i,
                                        acc, TMA, BLOCK_N, True, DOT_DT, P_DT, PREC)
        for start in range(tail, doc_hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            c_ok = cols < doc_hi
            k_t, v = _load_kv(K_pool, V_pool, doc_slot0 + cols, c_ok, kv_head_off, d, d_ok,
                              stride_pool_s, DOT_DT)
            s = tl.dot(q, k_t, input_precision=PREC) * scale_log2
            s = tl.where(c_ok[None, :], s, float("-inf"))
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, True, PREC)
        gather_lo = tl.maximum(lo, doc_hi)
    for start in range(gather_lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        slots = tl.load(Req_to_token + req * stride_r2t + cols, mask=c_ok, other=0)
        if IDX64:
            slots = slots.to(tl.int64)
        k_sid = tl.load(Slot_sid + slots, mask=c_ok, other=-2)
        vis = ((k_sid[None, :] == -1) | (k_sid[None, :] == q_sid[:, None])) & c_ok[None, :]
        k_t, v = _load_kv(K_pool, V_pool, slots, c_ok, kv_head_off, d, d_ok, stride_pool_s,
                          DOT_DT)
        s = tl.dot(q, k_t, input_precision=PREC) * scale_log2
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, True, PREC)

    # Stage 2: the request's own new tokens, causal within them (only keys j < last row's tok).
    if split == num_splits - 1:
        j_hi = tl.where(live, tl.minimum(q_len, tok0 + TOKS), 0)
        for start in range(0, j_hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < j_hi
            j_idx = (q_start + j).to(tl.int64)
            k_sid = tl.load(Q_sid + j_idx, mask=j_ok, other=-2)
            vis = ((k_sid[None, :] == -1) | (k_sid[None, :] == q_sid[:, None]))
            vis = vis & (j[None, :] <= tok[:, None]) & j_ok[None, :]
            needed = tl.max(vis.to(tl.int32), axis=0) > 0
            kv_mask = needed[:, None] & d_ok[None, :]
            k = tl.load(K_new + j_idx[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0).to(DOT_DT)
            v = tl.load(V_new + j_idx[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0).to(DOT_DT)
            s = tl.where(vis, tile_scores(q, k, scale_log2, True, PREC), float("-inf"))
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, True, PREC)

    write_rows(
        acc, m_i, l_i, q_start + tok, head, row_ok, state_offset + split,
        O, Lse, Part_o, Part_lse,
        stride_ot, stride_oh, stride_lt, stride_lh,
        stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
        HEAD_DIM, BLOCK_D, WRITE_PARTIAL, WRITE_LSE,
    )


def _tiling(device, dtype, group: int, max_extend_len: int, tiles: _arch.Tiles | None = None,
            contiguous: bool = False) -> tuple[_arch.Tiles, int, int]:
    """(tiles, rows per query tile, query tiles per request and KV head)."""
    tiles = tiles or _arch.extend_tiles(device, dtype, max_extend_len * group, contiguous)
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    return tiles, block_m, triton.cdiv(max(max_extend_len, 1), block_m // group)


def extend_splits(device: torch.device, dtype: torch.dtype, batch: int, num_tokens: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, max_extend_len: int,
                  max_prefix_len: int, scratch: PartialScratch | None = None,
                  contiguous: bool = False) -> int:
    """The split count extend_attention picks (host-side, from shapes and maxima only).
    contiguous: the launch will pass doc_start/doc_len (its tiles; splits that fill whole waves,
    `wave_splits`: 3 splits left Qwen2.5's 128 programs in 1.5 waves, 0.43 ms vs 0.35 at 2)."""
    tiles, _, m_tiles = _tiling(device, dtype, num_heads // num_kv_heads, max_extend_len,
                                contiguous=contiguous)
    cap = scratch.max_states(num_tokens, num_heads, head_dim) if scratch else _arch.MAX_SPLITS
    programs = batch * num_kv_heads * m_tiles
    return _arch.row_splits(programs, max_prefix_len, device, cap, tiles, contiguous)


def extend_attention(
    q, k_new, v_new, o, k_pool, v_pool, req_to_token, req_indices, kv_start, prefix_lens,
    qo_indptr, q_sid, slot_sid, max_extend_len: int, sm_scale: float,
    lse: torch.Tensor | None = None, max_prefix_len: int | None = None,
    num_splits: int | None = None, scratch: PartialScratch | None = None,
    tiles: _arch.Tiles | None = None,
    doc_start: torch.Tensor | None = None, doc_len: torch.Tensor | None = None,
    tma: bool | None = None,
) -> int:
    """Writes o [T, Hq, D] (and lse [T, Hq] float32, natural log). Returns the split count used.

    q [T, Hq, D]; k_new/v_new [T, Hkv, D]; pools [S, Hkv, D]; req_to_token [R, L] int32;
    req_indices/kv_start/prefix_lens [B] int32; qo_indptr [B+1] int32; q_sid [T] int32;
    slot_sid [S] int32. max_prefix_len (host int, an upper bound) only steers the split count.
    tiles overrides the per-device choice (benchmark sweeps).
    doc_start/doc_len [B] int32 (both or neither): row positions [0, doc_len[b]) of request b
    are the slots doc_start[b] + i, all with slot_sid -1; they are read without req_to_token or
    slot_sid. doc_len[b] = 0: no contiguous document known, the whole row is gathered.
    tma: the documents' whole tiles read through tensor descriptors (`_arch.kv_descriptors`);
    None: `_arch.use_tma`.
    """
    if (doc_start is None) != (doc_len is None):
        raise ValueError("extend_attention takes doc_start and doc_len together, or neither")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    batch = req_indices.shape[0]
    if num_tokens == 0 or batch == 0:
        return 0
    group = num_heads // num_kv_heads
    device = q.device
    has_doc = doc_start is not None
    tiles, block_m, m_tiles = _tiling(device, q.dtype, group, max_extend_len, tiles, has_doc)
    if num_splits is None:
        bound = max_prefix_len if max_prefix_len is not None else req_to_token.shape[1]
        num_splits = extend_splits(device, q.dtype, batch, num_tokens, num_heads, num_kv_heads,
                                   head_dim, max_extend_len, bound, scratch, has_doc)
    write_partial = num_splits > 1
    if write_partial:
        part_o, part_lse = partial_buffers(scratch, num_tokens, num_heads, num_splits, head_dim, device)
    else:
        part_o, part_lse = o, o  # unused by the kernel
    lse_arg = lse if lse is not None else o
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k_pool.dtype, device)
    descs = _arch.kv_descriptors(k_pool, v_pool, tiles.block_n, tma) if has_doc else None
    grid = (batch, num_kv_heads * m_tiles, num_splits)
    _extend_kernel[grid](
        q, k_new, v_new, o, lse_arg, part_o, part_lse,
        k_pool, v_pool, *(descs or (k_pool, v_pool)), req_to_token, req_indices, kv_start,
        prefix_lens, qo_indptr, q_sid, slot_sid,
        doc_start if has_doc else kv_start, doc_len if has_doc else kv_start,
        sm_scale * math.log2(math.e), m_tiles, 0, num_splits,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        o.stride(0), o.stride(1), *lse_strides(lse), *partial_strides(part_o, part_lse, write_partial),
        k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        WRITE_PARTIAL=write_partial, WRITE_LSE=lse is not None, HAS_DOC=has_doc,
        DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=_arch.needs_int64(k_pool),
        TMA=descs is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if write_partial:
        merge_partials(part_o, part_lse, o, lse)
    return num_splits


def extend_attention_ref(
    q, k_new, v_new, k_pool, v_pool, req_to_token, req_indices, kv_start, prefix_lens,
    qo_indptr, q_sid, slot_sid, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (o [T, Hq, D], lse [T, Hq]) from a dense mask built request by request."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    # float64 on the inputs' device (a GPU does the reference in seconds); indices from the CPU
    dev = q.device
    table, indptr = req_to_token.cpu(), qo_indptr.tolist()
    rows, starts, ends = req_indices.tolist(), kv_start.tolist(), prefix_lens.tolist()
    for b in range(len(rows)):
        t0, t1 = indptr[b], indptr[b + 1]
        if t1 == t0:
            continue
        row = table[rows[b], starts[b]: ends[b]].long().to(dev)
        keys_k = torch.cat([k_pool[row], k_new[t0:t1]])
        keys_v = torch.cat([v_pool[row], v_new[t0:t1]])
        key_sid = torch.cat([slot_sid[row], q_sid[t0:t1]]).long()
        qs = q_sid[t0:t1].long()
        n_new = t1 - t0
        causal = torch.ones(n_new, len(row) + n_new, dtype=torch.bool, device=dev)
        causal[:, len(row):] = torch.tril(torch.ones(n_new, n_new, dtype=torch.bool, device=dev))
        stream_ok = (key_sid[None, :] == -1) | (key_sid[None, :] == qs[:, None])
        o[t0:t1], lse[t0:t1] = masked_attention_ref(
            q[t0:t1], keys_k, keys_v, causal & stream_ok, sm_scale
        )
    return o.cpu(), lse.cpu()


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
