"""Triton helpers shared by the attention kernels: one key tile's online-softmax step and the
final write of a query tile (to the output, or to a partial-state slot for `merge_partials`).

Scores are kept in log2 units (q.k * sm_scale * log2 e) so the kernels can use exp2; the lse
they write is converted back to natural log. Running maxima start at a large finite negative
value, not -inf, so a row that sees no key in a tile never computes (-inf) - (-inf).

`DOT_DT` is the dtype fed to tl.dot: the pool dtype on a GPU; float32 under the CPU
interpreter for bf16, whose numpy emulation multiplies raw bf16 bits. `P_DT` is the pool dtype:
probabilities are rounded to it before P.V, as on the GPU.
"""

import triton
import triton.language as tl

from ppqa.kernels._keys import settle_cache_keys

# Globals read inside @triton.jit code must be tl.constexpr instances (an annotation is not enough).
LN2 = tl.constexpr(0.6931471805599453)
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def tile_scores(q, k, scale_log2, USE_DOT: tl.constexpr, PREC: tl.constexpr):
    """[M, D] x [N, D] -> [M, N] scaled scores; without a dot, M must be 1 (one query row)."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    else:
        q1 = tl.sum(q.to(tl.float32), axis=0)  # the single row
        s = tl.sum(q1[None, :] * k.to(tl.float32), axis=1)[None, :]
    return s * scale_log2


@triton.jit
def softmax_update(
    s, v, m_i, l_i, acc,
    P_DT: tl.constexpr, DOT_DT: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
):
    """Folds one tile of masked scores s [M, N] (-inf where hidden) and values v [N, D] in."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(P_DT).to(DOT_DT), v, input_precision=PREC)
    else:
        p1 = tl.sum(p, axis=0)
        pv = tl.sum(p1[:, None] * v.to(tl.float32), axis=0)[None, :]
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def softmax_fold(
    s_raw, v, m_i, l_i, acc, scale_log2,
    P_DT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
):
    """softmax_update for raw scores s_raw = q.k [M, N] (-inf where hidden), for the
    compute-bound document product: the scale rides in the exponent's multiply-add instead of a
    pass of its own, and P.V accumulates inside the dot (no separate add). The same result up to
    rounding. The rescale of acc is not skipped while no row maximum grows past a slack
    (FlashAttention-4's threshold): the branch between the two dots costs more than the
    multiply it skips (benchmarks/RESULTS.md, "Cascade's decode step")."""
    m_new = tl.maximum(m_i, tl.max(s_raw, axis=1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s_raw * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(P_DT).to(DOT_DT), v, acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def write_rows(
    acc, m_i, l_i, tok, head, row_ok, state,
    O, Lse, Part_o, Part_lse,
    stride_ot, stride_oh, stride_lt, stride_lh,
    stride_pt, stride_ph, stride_ps, stride_plt, stride_plh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Normalises and stores a query tile. tok/head/row_ok: [M]; state: partial-state index."""
    d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tok = tok.to(tl.int64)
    if WRITE_PARTIAL:
        base = tok * stride_pt + head * stride_ph + state * stride_ps
        tl.store(Part_o + base[:, None] + d[None, :], out, mask=ok)
        tl.store(Part_lse + tok * stride_plt + head * stride_plh + state, lse, mask=row_ok)
    else:
        dst = tok * stride_ot + head * stride_oh
        tl.store(O + dst[:, None] + d[None, :], out.to(O.dtype.element_ty), mask=ok)
        if WRITE_LSE:
            tl.store(Lse + tok * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit
def doc_run(Doc_start, Doc_len, b, hi, IDX64: tl.constexpr):
    """Request b's contiguous document within [.., hi): (end of that piece, its first slot).
    Row positions below the end are slot first + position (kernels' HAS_DOC paths)."""
    doc_hi = tl.minimum(hi, tl.load(Doc_len + b))
    slot0 = tl.load(Doc_start + b)
    if IDX64:
        slot0 = slot0.to(tl.int64)
    return doc_hi, slot0


@triton.jit
def tma_tiles(q, K_desc, V_desc, slot0, lo, hi, col, scale_log2, m_i, l_i, acc,
              TMA: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
              DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr,
              FOLD: tl.constexpr = False):
    """The whole key tiles of row positions [lo, hi) of a contiguous document (slots slot0 + i)
    through tensor descriptors, one 2-D block each of K and V at (slot, col), every key visible.
    Returns (the first position left for the caller's masked loop, m_i, l_i, acc); without TMA
    (K_desc/V_desc are then the pools, unused) it reads nothing and leaves the row from lo.
    FOLD (tl.dot tiles only): each tile's softmax step is `softmax_fold`."""
    tail = lo
    if TMA:
        tail = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, tail, BLOCK_N):
            row = (slot0 + start).to(tl.int32)
            k = K_desc.load([row, col]).to(DOT_DT)
            v = V_desc.load([row, col]).to(DOT_DT)
            if FOLD:
                s = tl.dot(q, tl.trans(k), input_precision=PREC)
                m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, scale_log2, P_DT, DOT_DT, PREC)
            else:
                s = tile_scores(q, k, scale_log2, USE_DOT, PREC)
                m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, P_DT, DOT_DT, USE_DOT, PREC)
    return tail, m_i, l_i, acc


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
