"""Shared-prefix (cascade) attention: the document part of a decode step, computed once for
every request that shares the document.

Requests are grouped by document (CascadeMetadata: group g owns batch rows
[group_req_indptr[g], group_req_indptr[g+1]) and its document is the row prefix
req_to_token[doc_req_indices[g], 0:doc_lens[g]]). For each group and KV head, the group's
queries (requests x the KV head's query heads, as rows) meet the document's keys in a tiled
matrix-matrix product (tl.dot), instead of one matrix-vector product per request. Grid:
(query tile, KV head, group x split): query tiles run fastest, so the tiles that read the same
document piece run together and share it through L2. The document is split along its length
so that even a few heads x tiles fill the GPU; each split writes a partial state.

Contiguous documents (doc_starts given, group g's document = slots doc_starts[g] + i): a
constexpr variant reads K/V at affine addresses, without req_to_token, so Triton's pipeliner
issues them as async copies stages ahead; it is a plain FlashAttention forward, with its own
tiles (`_arch.contig_prefix_tiles`), a split count that fills whole waves (`wave_splits`) and
the folded softmax step (`_tile.softmax_fold`: this product is compute-bound).
On sm_90 its whole key tiles come through tensor descriptors instead (`_tile.tma_tiles`: one
2-D copy per K or V tile), the last partial tile through masked loads.

Where a CUDA graph's plan would leave much of the GPU idle, the backend takes the stream-K form
of the contiguous kernel instead (`cascade_stream.py`, which shares `contig_run` with it).

The decode step's suffix (row[doc_len : seq_len] per request) goes through decode_attention,
and the partial states of both are combined by log-sum-exp (`merge_partials`; the backend
writes both into one buffer and merges once).
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
    NEG_BIG, softmax_fold, softmax_update, tile_scores, tma_tiles, write_rows,
)
from ppqa.kernels.merge import PartialScratch, merge_partials, partial_buffers, partial_strides


@triton.jit
def contig_run(q, K_pool, V_pool, K_desc, V_desc, slot0, lo, hi, kvh, stride_pool_s,
                stride_pool_h, scale_log2, m_i, l_i, acc,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr,
                TMA: tl.constexpr):
    """Folds keys [lo, hi) of a contiguous document (slots slot0 + i), KV head kvh, into the
    query tile's running state: whole tiles through tensor descriptors where TMA, the rest
    through masked loads."""
    tail, m_i, l_i, acc = tma_tiles(q, K_desc, V_desc, slot0, lo, hi,
                                    (kvh * HEAD_DIM).to(tl.int32), scale_log2, m_i, l_i,
                                    acc, TMA, BLOCK_N, True, DOT_DT, P_DT, PREC, True)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kv_head_off = kvh * stride_pool_h
    for start in range(tail, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        slots = slot0 + cols
        # K transposed ([D, N]) feeds tl.dot as its B operand without a layout change.
        k_t = tl.load(K_pool + slots[None, :] * stride_pool_s + kv_head_off + d[:, None],
                      mask=c_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DT)
        v = tl.load(V_pool + slots[:, None] * stride_pool_s + kv_head_off + d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)
        s = tl.where(c_ok[None, :], tl.dot(q, k_t, input_precision=PREC), float("-inf"))
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, scale_log2, P_DT, DOT_DT, PREC)
    return m_i, l_i, acc


# Counts and offsets that change from step to step, and the partial lse strides (they follow
# the state count), are not specialised on (== 1, a multiple of 16): each such class of values
# would be one more variant to compile.
@triton.jit(do_not_specialize=["state_offset", "num_splits", "stride_plt", "stride_plh"])
def _prefix_kernel(
    Q, Part_o, Part_lse,
    K_pool, V_pool, K_desc, V_desc, Req_to_token, Group_indptr, Doc_req, Doc_lens, Doc_starts,
    scale_log2, state_offset, num_splits,
    stride_qt, stride_qh,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
    stride_pool_s, stride_pool_h, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CONTIG: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    m_tile = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    REQS: tl.constexpr = BLOCK_M // GROUP  # requests per query tile

    r0 = tl.load(Group_indptr + g)
    n_req = tl.load(Group_indptr + g + 1) - r0
    r = tl.arange(0, BLOCK_M)
    local = m_tile * REQS + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < REQS * GROUP) & (local < n_req)
    tok = r0 + local  # a decode step has one token per request: token index = batch row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)

    doc_len = tl.load(Doc_lens + g)
    chunk = tl.cdiv(tl.cdiv(doc_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, doc_len)
    hi = tl.where(m_tile * REQS < n_req, hi, lo)  # tiles past the group's requests do nothing

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head_off = kvh * stride_pool_h
    if CONTIG:
        slot0 = tl.load(Doc_starts + g)
        if IDX64:
            slot0 = slot0.to(tl.int64)
        m_i, l_i, acc = contig_run(q, K_pool, V_pool, K_desc, V_desc, slot0, lo, hi, kvh,
                                    stride_pool_s, stride_pool_h, scale_log2, m_i, l_i, acc,
                                    HEAD_DIM, BLOCK_D, BLOCK_N, DOT_DT, P_DT, PREC, TMA)
    else:
        doc = tl.load(Doc_req + g).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            c_ok = cols < hi
            slots = tl.load(Req_to_token + doc * stride_r2t + cols, mask=c_ok, other=0)
            if IDX64:
                slots = slots.to(tl.int64)
            kv_off = slots[:, None] * stride_pool_s + kv_head_off + d[None, :]
            kv_mask = c_ok[:, None] & d_ok[None, :]
            k = tl.load(K_pool + kv_off, mask=kv_mask, other=0.0).to(DOT_DT)
            v = tl.load(V_pool + kv_off, mask=kv_mask, other=0.0).to(DOT_DT)
            s = tl.where(c_ok[None, :], tile_scores(q, k, scale_log2, True, PREC), float("-inf"))
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, True, PREC)

    write_rows(
        acc, m_i, l_i, tok, head, row_ok, state_offset + split,
        Part_o, Part_lse, Part_o, Part_lse,
        0, 0, 0, 0,
        stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
        HEAD_DIM, BLOCK_D, True, False,
    )


def tiling(device, dtype, group: int, max_group_size: int, tiles: _arch.Tiles | None = None,
           contiguous: bool = False) -> tuple[_arch.Tiles, int, int]:
    """(tiles, rows per query tile, query tiles per group and KV head)."""
    choose = _arch.contig_prefix_tiles if contiguous else _arch.prefix_tiles
    tiles = tiles or choose(device, dtype, max_group_size * group)
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    return tiles, block_m, triton.cdiv(max(max_group_size, 1), block_m // group)


def group_size_bound(device, dtype, group: int, size: int, contiguous: bool) -> int:
    """The group size a CUDA graph of cascade steps is captured for, given a step's largest
    group: a power of two, or fewer where a whole number of query tiles holds `size`; and
    where `size` fits one query tile, that tile's requests (when the kernel tile for them is
    the one for that power of two). The graph's grid and its document splits are fixed for
    the bound: a bound past the query tiles the step's groups fill plans its splits for tiles
    that return at once, so fewer CTAs work than the GPU has room for (Qwen2.5-7B, 18
    requests a group: 32 gave 2 query tiles where one is busy, hence 2 splits where 5 fit,
    and its document kernel ran at about half the rate of the exact plan;
    results/h200/cascade_groups_bounds_s19c4.json). Within one tile every size plans alike,
    so steps whose largest groups differ there share one graph: documents of 16 questions
    arriving while others decode met groups of 16, 32 and 64 requests, each a graph of its
    own, where one 64-row tile serves them all
    (results/h100/wtimeline_labeling_arrivals_b256_s40c2.json)."""
    bound = triton.next_power_of_2(size)
    tiles, block_m, _ = tiling(device, dtype, group, bound, contiguous=contiguous)
    per_tile = max(1, block_m // group)
    if size <= per_tile and \
            tiling(device, dtype, group, per_tile, contiguous=contiguous)[:2] == (tiles, block_m):
        return per_tile
    return min(bound, triton.cdiv(size, per_tile) * per_tile)


def prefix_splits(device: torch.device, dtype: torch.dtype, batch: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, num_groups: int, max_group_size: int,
                  max_doc_len: int, scratch: PartialScratch | None = None,
                  reserved_states: int = 0, contiguous: bool = False) -> int:
    """Document splits for a step; host-side, from the cascade metadata's maxima.
    reserved_states: scratch states already promised to the suffix's decode splits.
    contiguous: the launch will pass doc_starts (its tiles and a wave-filling split count)."""
    tiles, _, m_tiles = tiling(device, dtype, num_heads // num_kv_heads, max_group_size,
                               contiguous=contiguous)
    cap = scratch.max_states(batch, num_heads, head_dim) if scratch else _arch.MAX_SPLITS
    cap = max(1, cap - reserved_states)
    programs = m_tiles * num_kv_heads * num_groups
    return _arch.row_splits(programs, max_doc_len, device, cap, tiles, contiguous)


def launch_shared_prefix(
    q, k_pool, v_pool, req_to_token, group_req_indptr, doc_req_indices, doc_lens,
    max_group_size: int, sm_scale: float, num_splits: int, part_o, part_lse,
    state_offset: int = 0, tiles: _arch.Tiles | None = None,
    doc_starts: torch.Tensor | None = None, tma: bool | None = None,
) -> None:
    """Partial states of the document part into part_o[:, :, state_offset : +num_splits].
    doc_starts [G] int32: group g's document is the slots doc_starts[g] + i, i < doc_lens[g]
    (read at affine addresses, req_to_token untouched); None: gathered through req_to_token.
    tma (contiguous documents only): whole tiles read through tensor descriptors
    (`_arch.kv_descriptors`); None: `_arch.use_tma`."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    contiguous = doc_starts is not None
    tiles, block_m, m_tiles = tiling(q.device, q.dtype, group, max_group_size, tiles,
                                     contiguous)
    num_groups = doc_req_indices.shape[0]
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k_pool.dtype, q.device)
    descs = _arch.kv_descriptors(k_pool, v_pool, tiles.block_n, tma) if contiguous else None
    _prefix_kernel[(m_tiles, num_kv_heads, num_groups * num_splits)](
        q, part_o, part_lse,
        k_pool, v_pool, *(descs or (k_pool, v_pool)), req_to_token, group_req_indptr,
        doc_req_indices, doc_lens,
        doc_starts if contiguous else doc_lens,
        sm_scale * math.log2(math.e), state_offset, num_splits,
        q.stride(0), q.stride(1), *partial_strides(part_o, part_lse, True),
        k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, CONTIG=contiguous,
        DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=_arch.needs_int64(k_pool),
        TMA=descs is not None, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def split_fill(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               num_groups: int, max_group_size: int, num_splits: int) -> float:
    """The share of the GPU's CTA slots, over the waves they take, that the split kernel's
    working CTAs fill for `num_groups` documents of up to `max_group_size` requests at
    `num_splits` splits (contiguous documents; 1.0 is whole waves)."""
    tiles, _, m_tiles = tiling(device, dtype, num_heads // num_kv_heads, max_group_size,
                               contiguous=True)
    slots = _arch.num_sms(device) * _arch.resident_ctas(tiles)
    working = max(1, m_tiles * num_kv_heads * num_groups * num_splits)
    return working / (triton.cdiv(working, slots) * slots)


def shared_prefix_attention(
    q, o, lse, k_pool, v_pool, req_to_token, group_req_indptr, doc_req_indices, doc_lens,
    max_group_size: int, max_doc_len: int, sm_scale: float,
    num_splits: int | None = None, scratch: PartialScratch | None = None,
    doc_starts: torch.Tensor | None = None, tiles: _arch.Tiles | None = None,
    tma: bool | None = None,
) -> int:
    """Writes o [B, Hq, D] and lse [B, Hq] (natural log) of each request's query against its
    group's document only. q [B, Hq, D], one decode token per request. Returns the splits.
    doc_starts, tma: as launch_shared_prefix."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return 0
    if num_splits is None:
        num_splits = prefix_splits(q.device, q.dtype, batch, num_heads, k_pool.shape[1],
                                   head_dim, doc_req_indices.shape[0], max_group_size,
                                   max_doc_len, scratch, contiguous=doc_starts is not None)
    part_o, part_lse = partial_buffers(scratch, batch, num_heads, num_splits, head_dim, q.device)
    launch_shared_prefix(q, k_pool, v_pool, req_to_token, group_req_indptr, doc_req_indices,
                         doc_lens, max_group_size, sm_scale, num_splits, part_o, part_lse,
                         tiles=tiles, doc_starts=doc_starts, tma=tma)
    merge_partials(part_o, part_lse, o, lse)
    return num_splits


def shared_prefix_attention_ref(
    q, k_pool, v_pool, req_to_token, group_req_indptr, doc_req_indices, doc_lens, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (o, lse): every request of group g against the group's document, densely."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    # float64 on the inputs' device (a GPU does the reference in seconds); indices from the CPU
    dev = q.device
    table = req_to_token.cpu()
    for g in range(doc_req_indices.shape[0]):
        b0, b1 = int(group_req_indptr[g]), int(group_req_indptr[g + 1])
        row = table[int(doc_req_indices[g]), : int(doc_lens[g])].long().to(dev)
        if b1 == b0 or len(row) == 0:
            continue
        mask = torch.ones(b1 - b0, len(row), dtype=torch.bool, device=dev)
        o[b0:b1], lse[b0:b1] = masked_attention_ref(
            q[b0:b1], k_pool[row], v_pool[row], mask, sm_scale
        )
    return o.cpu(), lse.cpu()


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
