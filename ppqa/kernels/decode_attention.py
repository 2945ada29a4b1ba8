"""Paged split-KV decode attention: the `stock` baseline (one query token per request).

Request b's query attends to its row req_to_token[req, kv_start:seq_len] (no stream rule: a
stock request holds one question). When the row starts with a document whose slots are one run
(`doc_start`/`doc_len`), that part is read at affine addresses, without req_to_token loads (on
sm_90 its whole tiles through tensor descriptors: `_tile.tma_tiles`, one 2-D copy per K or V
tile: benchmarks/RESULTS.md, 'TMA against pointer loads'). Grid: (request, KV head, split).
A program holds all query heads of one KV head (GQA: the heads form the rows of a tl.dot tile,
so each KV tile is read once per request; MHA: one row, multiply-and-sum on the CUDA cores) and
reads one piece of the row. With more than one split each piece writes a partial state and
`merge_partials` reduces them (flash-decoding). The split count is a host choice from the batch
shape, the longest row and the SM count, so a CUDA graph captured with an upper bound keeps its
grid; each program reads its real row length from `seq_lens`.
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
def _decode_tile(q, K_pool, V_pool, slots, c_ok, kv_head_off, d, d_ok, stride_pool_s,
                 scale_log2, m_i, l_i, acc, USE_DOT: tl.constexpr, DOT_DT: tl.constexpr,
                 P_DT: tl.constexpr, PREC: tl.constexpr):
    """One key tile at `slots` (gathered or affine) folded into the running softmax."""
    kv_off = slots[:, None] * stride_pool_s + kv_head_off + d[None, :]
    kv_mask = c_ok[:, None] & d_ok[None, :]
    k = tl.load(K_pool + kv_off, mask=kv_mask, other=0.0).to(DOT_DT)
    v = tl.load(V_pool + kv_off, mask=kv_mask, other=0.0).to(DOT_DT)
    s = tl.where(c_ok[None, :], tile_scores(q, k, scale_log2, USE_DOT, PREC), float("-inf"))
    return softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, USE_DOT, PREC)


# Counts and offsets that change from step to step, and the partial lse strides (they follow
# the state count), are not specialised on (== 1, a multiple of 16): each such class of values
# would be one more variant to compile.
@triton.jit(do_not_specialize=["state_offset", "num_splits", "stride_plt", "stride_plh"])
def _decode_kernel(
    Q, O, Lse, Part_o, Part_lse,
    K_pool, V_pool, K_desc, V_desc, Req_to_token, Req_idx, Kv_start, Seq_lens, Doc_start, Doc_len,
    scale_log2, seq_len_offset, state_offset, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
    stride_pool_s, stride_pool_h, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_DOC: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    USE_DOT: tl.constexpr = BLOCK_H > 1

    h = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + h
    row_ok = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)

    req = tl.load(Req_idx + b).to(tl.int64)
    kv0 = tl.load(Kv_start + b)
    kv1 = tl.load(Seq_lens + b) + seq_len_offset
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv1 - kv0, 0), num_splits), BLOCK_N) * BLOCK_N
    lo = kv0 + split * chunk
    hi = tl.minimum(lo + chunk, kv1)

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kv_head_off = kvh * stride_pool_h
    gather_lo = lo
    if HAS_DOC:
        # The document piece [lo, min(hi, doc_len)): slots doc_start + i, no req_to_token load.
        doc_hi, doc_slot0 = doc_run(Doc_start, Doc_len, b, hi, IDX64)
        tail, m_i, l_i, acc = tma_tiles(q, K_desc, V_desc, doc_slot0, lo, doc_hi,
                                        (kvh * HEAD_DIM).to(tl.int32), scale_log2, m_i, l_i,
                                        acc, TMA, BLOCK_N, USE_DOT, DOT_DT, P_DT, PREC)
        for start in range(tail, doc_hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _decode_tile(q, K_pool, V_pool, doc_slot0 + cols, cols < doc_hi,
                                         kv_head_off, d, d_ok, stride_pool_s, scale_log2,
                                         m_i, l_i, acc, USE_DOT, DOT_DT, P_DT, PREC)
        gather_lo = tl.maximum(lo, doc_hi)
    for start in range(gather_lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        slots = tl.load(Req_to_token + req * stride_r2t + cols, mask=c_ok, other=0)
        if IDX64:
            slots = slots.to(tl.int64)
        m_i, l_i, acc = _decode_tile(q, K_pool, V_pool, slots, c_ok, kv_head_off, d, d_ok,
                                     stride_pool_s, scale_log2, m_i, l_i, acc,
                                     USE_DOT, DOT_DT, P_DT, PREC)

    write_rows(
        acc, m_i, l_i, b + h * 0, head, row_ok, state_offset + split,
        O, Lse, Part_o, Part_lse,
        stride_ot, stride_oh, stride_lt, stride_lh,
        stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
        HEAD_DIM, BLOCK_D, WRITE_PARTIAL, WRITE_LSE,
    )


def decode_splits(device: torch.device, batch: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, max_seq_len: int, scratch: PartialScratch | None = None,
                  whole_rows: bool = True) -> int:
    """The split count decode_attention picks: fill the SMs, >= MIN_SPLIT_TOKENS keys a piece,
    and with whole_rows (a stock row, read from its start) pieces of at most
    _arch.DECODE_PIECE_KEYS. The cascade suffix passes False: its bound is the whole row, but it
    reads only the row's tail."""
    cap = scratch.max_states(batch, num_heads, head_dim) if scratch else _arch.MAX_SPLITS
    rule = _arch.decode_row_splits if whole_rows else _arch.choose_splits
    return rule(batch * num_kv_heads, max_seq_len, device, cap)


def launch_decode(
    q, k_pool, v_pool, req_to_token, req_indices, kv_start, seq_lens, sm_scale: float,
    num_splits: int, *, o=None, lse=None, part_o=None, part_lse=None, state_offset: int = 0,
    seq_len_offset: int = 0, tiles: _arch.Tiles | None = None,
    doc_start: torch.Tensor | None = None, doc_len: torch.Tensor | None = None,
    tma: bool | None = None,
) -> None:
    """One launch: final outputs into o (and lse) when part_o is None, else partial states
    num_splits wide at part_o[:, :, state_offset:]. seq_len_offset is added to seq_lens (the
    backend passes prefix_lens with offset 1 rather than allocating prefix_lens + 1).
    doc_start/doc_len [B] int32 (both or neither): row positions [0, doc_len[b]) of request b
    are the slots doc_start[b] + i, read without req_to_token; doc_len 0: all gathered.
    tma: the document's whole tiles read through tensor descriptors (`_arch.kv_descriptors`);
    None: `_arch.use_tma`."""
    if (doc_start is None) != (doc_len is None):
        raise ValueError("launch_decode takes doc_start and doc_len together, or neither")
    has_doc = doc_start is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    tiles = tiles or _arch.decode_tiles(q.device, q.dtype, group)
    descs = _arch.kv_descriptors(k_pool, v_pool, tiles.block_n, tma) if has_doc else None
    partial = part_o is not None
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k_pool.dtype, q.device)
    dummy = part_o if partial else o
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, o if o is not None else dummy, lse if lse is not None else dummy,
        part_o if partial else dummy, part_lse if partial else dummy,
        k_pool, v_pool, *(descs or (k_pool, v_pool)), req_to_token, req_indices, kv_start, seq_lens,
        doc_start if has_doc else kv_start, doc_len if has_doc else kv_start,
        sm_scale * math.log2(math.e), seq_len_offset, state_offset, num_splits,
        q.stride(0), q.stride(1), *(o.stride()[:2] if o is not None else (0, 0)),
        *lse_strides(lse), *partial_strides(part_o, part_lse, partial),
        k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_H=tiles.block_m, BLOCK_N=tiles.block_n,
        WRITE_PARTIAL=partial, WRITE_LSE=lse is not None and not partial, HAS_DOC=has_doc,
        DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=_arch.needs_int64(k_pool),
        TMA=descs is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def decode_attention(
    q, o, k_pool, v_pool, req_to_token, req_indices, kv_start, seq_lens, sm_scale: float,
    lse: torch.Tensor | None = None, max_seq_len: int | None = None,
    num_splits: int | None = None, scratch: PartialScratch | None = None,
    seq_len_offset: int = 0, tiles: _arch.Tiles | None = None,
    doc_start: torch.Tensor | None = None, doc_len: torch.Tensor | None = None,
    tma: bool | None = None,
) -> int:
    """Writes o [B, Hq, D] (and lse [B, Hq] float32, natural log). Returns the split count.

    q [B, Hq, D]: request b's query; it attends to row positions [kv_start[b], seq_lens[b] +
    seq_len_offset). max_seq_len (host int, an upper bound) only steers the split count.
    doc_start/doc_len: a contiguous document at the row's start; tma: how its tiles are read;
    both as in `launch_decode`.
    """
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return 0
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else req_to_token.shape[1]
        num_splits = decode_splits(q.device, batch, num_heads, k_pool.shape[1], head_dim, bound,
                                   scratch)
    if num_splits == 1:
        launch_decode(q, k_pool, v_pool, req_to_token, req_indices, kv_start, seq_lens, sm_scale,
                      1, o=o, lse=lse, seq_len_offset=seq_len_offset, tiles=tiles,
                      doc_start=doc_start, doc_len=doc_len, tma=tma)
        return 1
    part_o, part_lse = partial_buffers(scratch, batch, num_heads, num_splits, head_dim, q.device)
    launch_decode(q, k_pool, v_pool, req_to_token, req_indices, kv_start, seq_lens, sm_scale,
                  num_splits, part_o=part_o, part_lse=part_lse, seq_len_offset=seq_len_offset,
                  tiles=tiles, doc_start=doc_start, doc_len=doc_len, tma=tma)
    merge_partials(part_o, part_lse, o, lse)
    return num_splits


def decode_attention_ref(
    q, k_pool, v_pool, req_to_token, req_indices, kv_start, seq_lens, sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (o [B, Hq, D], lse [B, Hq]): each request against its row slice."""
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    # float64 on the inputs' device (a GPU does the reference in seconds); indices from the CPU
    dev = q.device
    table = req_to_token.cpu()
    rows, starts, ends = req_indices.tolist(), kv_start.tolist(), seq_lens.tolist()
    for b in range(q.shape[0]):
        row = table[rows[b], starts[b]: ends[b]].long().to(dev)
        if len(row) == 0:
            continue
        mask = torch.ones(1, len(row), dtype=torch.bool, device=dev)
        o[b: b + 1], lse[b: b + 1] = masked_attention_ref(
            q[b: b + 1], k_pool[row], v_pool[row], mask, sm_scale
        )
    return o.cpu(), lse.cpu()


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
