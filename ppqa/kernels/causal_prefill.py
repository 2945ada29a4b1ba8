"""Causal attention over one sequence: a document's first prefill chunk, exact, at the matrix
units' rate, with one compiled variant for every length (torch's cuDNN attention builds a plan
per length, 50-100 ms each; its FlashAttention runs Hopper at about half of cuDNN's rate:
benchmarks/RESULTS.md, "A first chunk's length").

q [T, H, D] are the last T of N = P + T positions (P earlier tokens: a template's opening
copied from a cached document); row i, at position P + i, sees keys 0..P + i of k, v
[N, Hkv, D]; query head h reads KV head h // GROUP.

One program per (query head, tile of BLOCK_M rows): the FlashAttention forward layout. Folding a
KV head's GROUP query heads into one tile's rows, as the cascade kernel does for decode's one
token per request, would read each key tile once for GROUP heads, but the rows of a tile would
then span BLOCK_M / GROUP positions and the causal diagonal would cut every tile; with one head
per program the tiles below the diagonal are whole, read without masks, and only the
BLOCK_M / BLOCK_N diagonal tiles are masked. The grid's first axis is the head, its second the
row tile taken from the last: the programs with the most keys start first and the short ones
fill the last wave, and the GROUP heads that read one KV head run side by side (L2).

On sm_90 the whole key tiles come through tensor descriptors (`_tile.tma_tiles`, each tile's
softmax step `softmax_fold`); elsewhere, and under the interpreter, through pointer loads.
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


# Lengths change from chunk to chunk: no specialisation on them (each class of values, == 1 or
# a multiple of 16, would be one more variant to compile).
@triton.jit(do_not_specialize=["tokens", "prior"])
def _causal_kernel(
    Q, O, K, V, K_desc, V_desc,
    scale_log2, tokens, prior,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DT: tl.constexpr, P_DT: tl.constexpr, PREC: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr,
):
    head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kvh = head // GROUP
    r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < tokens
    pos = prior + r  # each row's position: it sees keys 0..pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + r.to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the tile's first row are seen by every row: whole tiles of them unmasked.
    first = prior + m_tile * BLOCK_M
    whole = (first + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first + BLOCK_M, prior + tokens)
    tail, m_i, l_i, acc = tma_tiles(q, K_desc, V_desc, tl.full([], 0, tl.int32), 0, whole,
                                    (kvh * HEAD_DIM).to(tl.int32), scale_log2, m_i, l_i, acc,
                                    TMA, BLOCK_N, True, DOT_DT, P_DT, PREC, True)
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    for start in range(tail, whole, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if IDX64:
            cols = cols.to(tl.int64)
        # K transposed ([D, N]) feeds tl.dot as its B operand without a layout change.
        k_t = tl.load(k_head + cols[None, :] * stride_kt + d[:, None],
                      mask=d_ok[:, None], other=0.0).to(DOT_DT)
        v = tl.load(v_head + cols[:, None] * stride_vt + d[None, :],
                    mask=d_ok[None, :], other=0.0).to(DOT_DT)
        s = tl.dot(q, k_t, input_precision=PREC)
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, scale_log2, P_DT, DOT_DT, PREC)
    # The diagonal: keys [whole, hi) masked by position.
    for start in range(whole, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        if IDX64:
            cols = cols.to(tl.int64)
        k_t = tl.load(k_head + cols[None, :] * stride_kt + d[:, None],
                      mask=c_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DT)
        v = tl.load(v_head + cols[:, None] * stride_vt + d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DT)
        seen = (cols[None, :] <= pos[:, None]) & c_ok[None, :]
        s = tl.where(seen, tl.dot(q, k_t, input_precision=PREC), float("-inf"))
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, scale_log2, P_DT, DOT_DT, PREC)

    write_rows(
        acc, m_i, l_i, r, tl.zeros([BLOCK_M], tl.int32) + head, row_ok, 0,
        O, O, O, O,
        stride_ot, stride_oh, 0, 0,
        0, 0, 0, 0, 0,
        HEAD_DIM, BLOCK_D, False, False,
    )


def causal_tiles(device: torch.device, dtype: torch.dtype) -> _arch.Tiles:
    """sm_90 bf16/fp16: 128 rows x 64 keys, 8 warps (two warpgroups on wgmma), 3 stages, the
    Hopper forward config of Triton's fused-attention tutorial and of the contiguous cascade
    kernel (`_arch.contig_prefix_tiles`). On an H100 (results/h100/first_chunk_s36c3.json,
    benchmarks/first_chunk.py) it runs 462-513 TFLOP/s from 5.7k to 16k tokens on both 7B
    models; 128 x 128 x 3 stages is up to 7% faster on Qwen2.5-7B and 8% slower on a 16k
    CodeLlama chunk, 64 x 64 x 4 warps best at 2k; two stages lose 20-36%. Tensor
    descriptors gain 1.5-7% over pointer loads from 5.7k tokens (none at 2k).
    fp32 (exact dots, tests): 32 x 32 x 8 warps. Interpreter: small query tiles, long key
    tiles (fewer loop iterations)."""
    if not _arch.is_gpu(device):
        return _arch.Tiles(16, 32, 4, 1)
    if dtype == torch.float32:
        return _arch.Tiles(32, 32, 8, 2)
    return _arch.Tiles(128, 64, 8, 3)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     sm_scale: float, tiles: _arch.Tiles | None = None,
                     tma: bool | None = None) -> None:
    """o [T, H, D] = causal attention of q [T, H, D], the last T of the N positions of k, v
    [N, Hkv, D] (see the module's docstring). Each tensor's last dimension contiguous; q, o
    and k, v may be views with any token and head strides. tma: whole key tiles through
    tensor descriptors (None: `_arch.use_tma`)."""
    tokens, num_heads, head_dim = q.shape
    keys, num_kv_heads = k.shape[0], k.shape[1]
    if keys < tokens:
        raise ValueError(f"k holds {keys} positions, fewer than the {tokens} queries")
    if tokens == 0:
        return
    tiles = tiles or causal_tiles(q.device, q.dtype)
    dot_dt, p_dt, prec = _arch.kernel_dtypes(k.dtype, q.device)
    descs = _arch.kv_descriptors(k, v, tiles.block_n, tma)
    idx64 = max(keys * k.stride(0), keys * v.stride(0)) >= 2**31
    _causal_kernel[(num_heads, triton.cdiv(tokens, tiles.block_m))](
        q, o, k, v, *(descs or (k, v)),
        sm_scale * math.log2(math.e), tokens, keys - tokens,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, DOT_DT=dot_dt, P_DT=p_dt, PREC=prec, IDX64=idx64,
        TMA=descs is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """Float64 o [T, H, D] of `causal_attention`: row i sees keys 0..N - T + i."""
    tokens, keys = q.shape[0], k.shape[0]
    pos = torch.arange(tokens, device=q.device)[:, None] + (keys - tokens)
    mask = torch.arange(keys, device=q.device)[None, :] <= pos
    return masked_attention_ref(q, k, v, mask, sm_scale)[0]


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
