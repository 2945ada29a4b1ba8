"""Scatter a step's new K/V rows into their pool slots (one launch for K and V together).

The backend calls `store_kv` once per layer before attending: token t's K and V
([num_kv_heads, head_dim] each) go to slot out_slots[t] of that layer's pool buffers. Padding
tokens point at slot 0, the sink, so no token is ever skipped and the grid is the token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys


# Counts and offsets that change from step to step are not specialised on (== 1, a multiple
# of 16): each such class of values would be one more variant to compile.
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kernel(
    K_pool, V_pool, Slots, K, V, num_tokens,
    stride_pool_s, stride_pool_h, stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < num_tokens
    slot = tl.load(Slots + t, mask=t_ok, other=0).to(tl.int64)
    t = t.to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hd_ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    ok = t_ok[:, None, None] & hd_ok[None, :, :]
    dst = slot[:, None, None] * stride_pool_s + (h[:, None] * stride_pool_h + d[None, :])[None]
    k = tl.load(K + t[:, None, None] * stride_kt + (h[:, None] * stride_kh + d[None, :])[None],
                mask=ok)
    tl.store(K_pool + dst, k.to(K_pool.dtype.element_ty), mask=ok)
    v = tl.load(V + t[:, None, None] * stride_vt + (h[:, None] * stride_vh + d[None, :])[None],
                mask=ok)
    tl.store(V_pool + dst, v.to(V_pool.dtype.element_ty), mask=ok)


def store_kv(
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    out_slots: torch.Tensor,  # [T] int64 (or int32)
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_pool.shape[1:] == (num_kv_heads, head_dim), (k_pool.shape, k.shape)
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(2) == 1
    assert k.stride(2) == 1 and v.stride(2) == 1
    # One token per program on a GPU (a row is 1-16 KiB); many under the interpreter, where
    # each program costs milliseconds.
    tokens = 1 if _arch.is_gpu(k.device) else 64
    _store_kernel[(triton.cdiv(num_tokens, tokens),)](
        k_pool, v_pool, out_slots, k, v, num_tokens,
        k_pool.stride(0), k_pool.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, TOKENS=tokens,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def store_kv_ref(k_pool, v_pool, out_slots, k, v) -> None:
    k_pool[out_slots.long()] = k.to(k_pool.dtype)
    v_pool[out_slots.long()] = v.to(v_pool.dtype)


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
