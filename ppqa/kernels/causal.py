"""Causal self-attention over a document's first prefill chunk: a FlashAttention-style forward
that plans nothing, so one compiled variant serves every length.

Inputs come from the chunk's qkv projection (q [T, H, D], k/v [N, Hkv, D], views split from one
packed tensor are fine: strides go to the kernel, the last dim contiguous); the output goes to
o [T, H, D] in place. The N - T = P keys before the chunk (a template's opening copied from a
cached document, often 0) are visible to every query: query row i sits at position P + i and
sees keys 0..P+i (the causal mask aligned to the lower right). Grouped-query attention: query
head h reads KV head h // GROUP.

Grid: (query head, query tile of BLOCK_M rows), the query tiles in reverse: CUDA starts
programs in order of their linear index (heads fastest), so the tiles with the most keys start
first and the short ones fill the last wave, and the heads of one KV group run side by side,
reading the same K/V tiles from L2. One query head per program, rather than a KV head's GROUP
query heads folded into a tile's rows (as cascade.py does for a decode step's few rows): a
chunk of thousands of tokens gives thousands of programs without folding, each row of a tile
then sits at its own position (P + i, affine in the row), so the diagonal is a band of
BLOCK_M keys wide whatever GROUP is, Q and O are read and written as plain 2-D tiles, and a
GROUP that is not a power of two (Qwen2.5-7B's 7) wastes no rows on padding.

A query tile's key loop has two parts. Keys 0..P + its first row are visible to all its rows:
those whole key tiles are read without masks (on sm_90 through tensor descriptors, one 2-D
copy per K or V tile: `_tile.tma_tiles`; elsewhere pointer loads), and each tile's softmax
step is `_tile.softmax_fold` (the product is compute-bound). The remaining one or two tiles
that straddle the diagonal are read with bounds masks and the causal mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys
from ppqa.kernels._ref import masked_attention_ref
from ppqa.kernels._tile import NEG_BIG, softmax_fold, tma_tiles, write_rows


@triton.jit
def _pointer_tiles(q, K, V, lo, hi, limit, pos, k_off, v_off, d, d_ok, stride_kt, stride_vt,
                   scale_log2, m_i, l_i, acc,
                   BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr, P_DT: tl.constexpr,
                   PREC: tl.constexpr, IDX64: tl.constexpr, MASKED: tl.constexpr):
    """Key tiles [lo, hi) through pointer loads. MASKED: keys from `limit` on are not read
    and a row at position pos[i] sees keys <= pos[i] (the diagonal); else every key is
    visible and read (whole tiles below the diagonal)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if MASKED:
            c_ok = cols < limit
        else:
            c_ok = tl.full([BLOCK_N], 1, tl.int1)  # folds away: only the head-dim mask stays
        keys = cols.to(tl.int64) if IDX64 else cols
        # K transposed ([D, N]) feeds tl.dot as its B operand without a layout change.
        k_t = tl.load(K + k_off + keys[None, :] * stride_kt + d[:, None],
                      mask=c_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DT)
        v = tl.load(V + v_off + keys[:, None] * stride_vt + d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)
        s = tl.dot(q, k_t, input_precision=PREC)
        if MASKED:
            s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, scale_log2, P_DT, DOT_DT, PREC)
    return m_i, l_i, acc


# The chunk's length and its prior change from call to call: not specialised on (== 1, a
# multiple of 16), so that one variant serves every length.
@triton.jit(do_not_specialize=["num_tokens", "prior"])
def _causal_kernel(
    Q, K, V, O, K_desc, V_desc,
    scale_log2, num_tokens, prior,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    head = tl.program_id(0)
    m_tile = tl.program_id(1)  # the longest tiles first
    kvh = head // GROUP

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    pos = prior + rows  # each row's position among the keys
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys [0, shared) are visible to every row of the tile; the last row sees up to end - 1.
    shared = prior + m_tile * BLOCK_M + 1
    end = prior + tl.minimum(m_tile * BLOCK_M + BLOCK_M, num_tokens)
    diagonal = shared // BLOCK_N * BLOCK_N  # the first key tile that some row may not see
    key0 = tl.zeros([], tl.int32)  # k's row 0, a tensor (the interpreter's loop yields ints)
    tail, m_i, l_i, acc = tma_tiles(q, K_desc, V_desc, key0, 0, shared,
                                    (kvh * HEAD_DIM).to(tl.int32), scale_log2, m_i, l_i, acc,
                                    TMA, BLOCK_N, True, DOT_DT, P_DT, PREC, True)
    k_off, v_off = kvh * stride_kh, kvh * stride_vh
    if not TMA:  # the same whole tiles through pointer loads (tail is 0)
        m_i, l_i, acc = _pointer_tiles(q, K, V, tail, diagonal, end, pos, k_off, v_off, d,
                                       d_ok, stride_kt, stride_vt, scale_log2, m_i, l_i, acc,
                                       BLOCK_N, DOT_DT, P_DT, PREC, IDX64, False)
    m_i, l_i, acc = _pointer_tiles(q, K, V, diagonal, end, end, pos, k_off, v_off, d, d_ok,
                                   stride_kt, stride_vt, scale_log2, m_i, l_i, acc,
                                   BLOCK_N, DOT_DT, P_DT, PREC, IDX64, True)

    write_rows(
        acc, m_i, l_i, rows, head, row_ok, 0,
        O, O, O, O,
        stride_ot, stride_oh, 0, 0,
        0, 0, 0, 0, 0,
        HEAD_DIM, BLOCK_D, False, False,
    )


def causal_tiles(device: torch.device, dtype: torch.dtype, head_dim: int) -> _arch.Tiles:
    """Tiles of the causal kernel. GPU, bf16/fp16, head_dim <= 128: 128 query rows (two
    warpgroups of 64 on sm_90's wgmma) x 128 keys, 8 warps, 2 stages, the usual FlashAttention
    forward tile on Hopper; benchmarks/causal_prefill.py sweeps the alternatives. Larger heads
    take 64 x 64 x 4 warps (a 128-row accumulator of 256 columns would not fit the registers).
    fp32 (exact "ieee" dots, tests only): 16 x 32 x 4 warps, 96 registers and no spills
    (pointer loads; 32 x 32 x 8 warps, contig_prefix_tiles' fp32 tile, spills here). The
    interpreter: 16 x 16, so that the CPU tests meet several whole and diagonal tiles at a few
    dozen tokens."""
    if not _arch.is_gpu(device):
        return _arch.Tiles(16, 16, 4, 1)
    if dtype == torch.float32:
        return _arch.Tiles(16, 32, 4, 2)
    if head_dim > 128:
        return _arch.Tiles(64, 64, 4, 2)
    return _arch.Tiles(128, 128, 8, 2)


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, tma: bool | None = None):
    """Tensor descriptors of k and v [N, Hkv, D] viewed as [N, Hkv x D] rows (a block: block_n
    keys x one head), for `causal_attention`'s tma (None: `_arch.use_tma`). Unlike
    `_arch.kv_descriptors` (whole pools) the rows may be strided, as in column views of a
    packed qkv tensor; the heads of a row must be packed. None when tma is off or a tensor
    cannot take one (a head_dim that is not a power of two, heads not packed, a base or row
    not 16-byte aligned). fp32 (exact "ieee" dots on the FMA units, tests only) takes pointer
    loads unless tma says otherwise: with TMA tiles its kernels spill (184-1712 bytes on
    sm_90 for the tiles tried, none with pointer loads at 16 x 32 x 4 warps)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if tma is None:
        tma = _arch.use_tma(k.device) and k.dtype != torch.float32
    if not tma:
        return None
    keys, heads, head_dim = k.shape
    if head_dim & (head_dim - 1) or head_dim * k.element_size() < 16:
        return None
    for x in (k, v):
        if (x.shape != k.shape or x.stride(2) != 1 or (heads > 1 and x.stride(1) != head_dim)
                or x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16):
            return None
    return tuple(TensorDescriptor(x, [keys, heads * head_dim], [x.stride(0), 1],
                                  [block_n, head_dim]) for x in (k, v))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     scale: float, tiles: _arch.Tiles | None = None,
                     tma: bool | None = None) -> None:
    """Writes o [T, H, D] (in place) with causal attention of q [T, H, D] over k/v [N, Hkv, D],
    N >= T: query i at position N - T + i sees keys 0..N - T + i. Any strides, the last dim
    contiguous. tiles: None for `causal_tiles`. tma: whole key tiles through tensor
    descriptors (`kv_descriptors`); None: where `_arch.use_tma` says so."""
    tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    if num_keys < tokens or num_heads % num_kv_heads:
        raise ValueError(f"causal_attention: q {tuple(q.shape)} against k {tuple(k.shape)}: "
                         "needs N >= T keys and H a multiple of Hkv")
    if any(x.stride(-1) != 1 for x in (q, k, v, o)):
        raise ValueError("causal_attention: the last dim of q, k, v and o must be contiguous")
    if tokens == 0:
        return
    tiles = tiles or causal_tiles(q.device, q.dtype, head_dim)
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k.dtype, q.device)
    descs = kv_descriptors(k, v, tiles.block_n, tma)
    idx64 = max(x.shape[0] * x.stride(0) for x in (k, v)) >= 2**31
    _causal_kernel[(num_heads, triton.cdiv(tokens, tiles.block_m))](
        q, k, v, o, *(descs or (k, v)),
        scale * math.log2(math.e), tokens, num_keys - tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=idx64,
        TMA=descs is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Float64 o [T, H, D] on the CPU: query i sees keys 0..N - T + i, densely."""
    tokens, num_keys = q.shape[0], k.shape[0]
    visible = torch.ones(tokens, num_keys, dtype=torch.bool, device=q.device)
    o, _ = masked_attention_ref(q, k, v, visible.tril(num_keys - tokens), scale)
    return o.cpu()


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
