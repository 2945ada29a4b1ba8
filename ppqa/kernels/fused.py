"""The decoder layer's small elementwise ops, one launch each: RMSNorm (with the residual add),
SiLU(gate) * up, and the rotary embedding of q and k.

On a GPU `LlamaModel` calls these instead of its torch code (several kernels per op on tensors of
a few MiB: launch-bound). Each `<op>_ref` is that torch code (llama.py keeps its own copy: it must
run where triton is not installed), and each kernel reproduces its roundings: float32 arithmetic
on loaded values, rounded to the model dtype wherever torch rounds, multiplies and adds kept apart
(`enable_fp_fusion=False`: torch runs them as separate kernels, an FMA would round once where
torch rounds twice). What stays different is the order of RMSNorm's sum of squares and, on the
CPU interpreter, numpy's exp against torch's.

Outputs are new tensors (shapes fixed by the inputs, no host syncs): safe under CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to nearest-even in DTYPE, returned as float32.

    bfloat16 is rounded on the bits: the interpreter's float32 -> bfloat16 cast truncates,
    while torch (and the GPU's cvt.rn) round to nearest even. NaNs pass through unchanged.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        out = x.to(tl.float16).to(tl.float32)
    else:
        out = x
    return out


@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, Sum_out, hidden, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < hidden
    DTYPE: tl.constexpr = Out.dtype.element_ty
    x = tl.load(X + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + col, mask=ok, other=0.0).to(tl.float32)
        x = _round_to(x + r, DTYPE)
        tl.store(Sum_out + row * stride_s + col, x.to(DTYPE), mask=ok)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    normed = _round_to(x * tl.math.rsqrt(mean_sq + eps), DTYPE)
    w = tl.load(Weight + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + col, _round_to(w * normed, DTYPE).to(DTYPE), mask=ok)


def _launch_rms_norm(x, residual, weight, eps):
    tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.shape == (hidden,) and weight.dtype == x.dtype, \
        (x.shape, x.stride(), weight.shape, weight.dtype, x.dtype)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    summed = out  # without a residual the kernel neither reads Residual nor writes Sum_out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        summed = torch.empty_like(out)
    if tokens == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    # 16 elements a thread (32 at hidden 8192). Hidden 4096, 256 rows, bf16, H200, graph
    # replay: 3.2 us with the add, against 30.7 us for torch's add and norm kernels.
    _rms_norm_kernel[(tokens,)](
        x, x if residual is None else residual, weight, out, summed, hidden, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), summed.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(8, block // 512)), enable_fp_fusion=False,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> RMSNorm(x) [T, hidden], as `rms_norm_ref`."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [T, hidden] -> (RMSNorm(x + residual), x + residual), as `add_rms_norm_ref`.
    The sum is the running residual stream the next layer adds its output to."""
    return _launch_rms_norm(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@triton.jit
def _silu_and_mul_kernel(
    Gate_up, Out, inter, stride_in, stride_out,
    BLOCK: tl.constexpr, CUDA_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inter
    DTYPE: tl.constexpr = Out.dtype.element_ty
    gate = tl.load(Gate_up + row * stride_in + col, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(Gate_up + row * stride_in + inter + col, mask=ok, other=0.0).to(tl.float32)
    # torch's CUDA silu is x / (1 + expf(-x)) with an IEEE division; tl.exp would be ex2.approx.
    if CUDA_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = _round_to(tl.div_rn(gate, 1.0 + e), DTYPE)
    tl.store(Out + row * stride_out + col, _round_to(silu * up, DTYPE).to(DTYPE), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I], as `silu_and_mul_ref`."""
    tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    on_gpu = _arch.is_gpu(gate_up.device)
    # [256, 2 x 11008] bf16 on the H200: 6.5 us (torch's silu and mul: 15.5 us). Under the
    # interpreter a whole row per program: each program costs a numpy round trip.
    block = 1024 if on_gpu else triton.next_power_of_2(inter)
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0),
        BLOCK=block, CUDA_EXP=on_gpu, num_warps=4, enable_fp_fusion=False,
    )
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _rotate_heads(
    Src, Dst, stride_h, num_heads, cos1, cos2, sin1, sin2,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates one token's heads [num_heads, 2 * HALF] (row stride stride_h) into Dst (packed)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < num_heads) & (d < HALF)
    x1 = tl.load(Src + h * stride_h + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(Src + h * stride_h + HALF + d, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    DTYPE: tl.constexpr = Dst.dtype.element_ty
    tl.store(Dst + h * (2 * HALF) + d, _round_to(out1, DTYPE).to(DTYPE), mask=ok)
    tl.store(Dst + h * (2 * HALF) + HALF + d, _round_to(out2, DTYPE).to(DTYPE), mask=ok)


@triton.jit
def _rope_kernel(
    Q, K, Q_out, K_out, Positions, Cos, Sin, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(Positions + t).to(tl.int64) * stride_table
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    cos1 = tl.load(Cos + row + d, mask=d_ok, other=0.0)
    cos2 = tl.load(Cos + row + HALF + d, mask=d_ok, other=0.0)
    sin1 = tl.load(Sin + row + d, mask=d_ok, other=0.0)
    sin2 = tl.load(Sin + row + HALF + d, mask=d_ok, other=0.0)
    _rotate_heads(Q + t * stride_qt, Q_out + t * num_heads * (2 * HALF), stride_qh, num_heads,
                  cos1, cos2, sin1, sin2, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(K + t * stride_kt, K_out + t * num_kv_heads * (2 * HALF), stride_kh,
                  num_kv_heads, cos1, cos2, sin1, sin2, HALF, BLOCK_KVH, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] (any token and head strides, e.g. views of the fused qkv
    projection) rotated by positions [T] with the float32 tables cos/sin [max_pos, D] of
    `RotaryEmbedding` -> new contiguous q, k, as `apply_rope_ref`."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1, (q.stride(), k.stride())
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == head_dim
    assert cos.stride() == sin.stride() and cos.stride(1) == 1
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    # One program per token, all heads: 3.3 us for 256 tokens x 32 + 32 heads x 128 in bf16 on
    # the H200 (torch's gathers, casts, cat and muls: 59.4 us).
    _rope_kernel[(tokens,)](
        q, k, q_out, k_out, positions, cos, sin, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        num_warps=4, enable_fp_fusion=False,
    )
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(q, k, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
