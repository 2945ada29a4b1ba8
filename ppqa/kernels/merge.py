"""Combining partial attention states by their log-sum-exp.

Every attention kernel here can stop short of a final output and write, per (token, head), a
partial state: the softmax-normalised output over a subset of keys and that subset's
log-sum-exp (natural log; -inf when the subset held no visible key, and then o is not read).
The split-KV paths (flash-decoding) write one state per split, the cascade path writes the
document's splits and the suffix's splits side by side, and `merge_partials` reduces them all
in one launch. Partial buffers are [T, H, N, D] float32 (o) and [T, H, N] float32 (lse), N the
states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ppqa.kernels import _arch
from ppqa.kernels._keys import settle_cache_keys


# Counts, offsets and the lse strides (which follow the state count) are not specialised on
# (== 1, a multiple of 16): each such class of values would be one more variant to compile.
@triton.jit(do_not_specialize=["num_rows", "num_states", "stride_lt", "stride_lh",
                               "stride_st", "stride_sh"])
def _merge_kernel(
    Part_o, Part_lse, O, Lse,
    num_rows, num_heads, num_states,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ROWS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # States are read BLOCK_S at a time with a running maximum (online softmax over states), so
    # one compiled variant serves every state count.
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flattened (token, head) pairs
    row_ok = row < num_rows
    t = (row // num_heads).to(tl.int64)
    h = row % num_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_base = t * stride_lt + h * stride_lh
    o_base = t * stride_pt + h * stride_ph
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for s0 in range(0, num_states, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = row_ok[:, None] & (s[None, :] < num_states)
        lse = tl.load(Part_lse + lse_base[:, None] + s[None, :], mask=s_ok, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - safe)  # 0 while nothing was seen (top = -inf)
        w = tl.exp(lse - safe[:, None])  # 0 for empty states
        offs = o_base[:, None, None] + s[None, :, None] * stride_ps + d[None, None, :]
        # An empty state's o is not read: a kernel that marks states unused writes their lse
        # only (the stream-K document kernel).
        used = s_ok & (lse > float("-inf"))
        parts = tl.load(Part_o + offs, mask=used[:, :, None] & d_ok[None, None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.sum(parts * w[:, :, None], axis=1)
        total = total * rescale + tl.sum(w, axis=1)
        top = new_top
    seen = total > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    dst = (t * stride_ot + h * stride_oh)[:, None] + d[None, :]
    tl.store(O + dst, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse_out = top + tl.log(tl.where(seen, total, 1.0))  # -inf where no state saw a key
        tl.store(Lse + t * stride_st + h * stride_sh, lse_out, mask=row_ok)


# States read per loop step of the merge: the cascade's and split-KV's usual counts (2-16) in one
# step, ~2 us a launch over the count's own power of two at a full cascade step, less than it
# at 17-128 states with many rows (results/h200/merge_states_s15c5.json).
MERGE_STATES = 16


def merge_partials(
    part_o: torch.Tensor,  # [T, H, N, D] float32
    part_lse: torch.Tensor,  # [T, H, N] float32
    out: torch.Tensor,  # [T, H, D]
    lse: torch.Tensor | None = None,  # [T, H] float32
    block_states: int = MERGE_STATES,
) -> None:
    """Reduces N partial states per (token, head) into `out` (and their total lse), reading
    `block_states` (a power of two) of them per loop step; values other than MERGE_STATES
    compile variants of their own and serve only for measuring (benchmarks/merge_states.py)."""
    num_tokens, num_heads, num_states, head_dim = part_o.shape
    if num_tokens == 0:
        return
    assert part_o.stride(3) == 1 and part_lse.stride(2) == 1 and out.stride(2) == 1
    # Under the interpreter each program costs milliseconds: give it many rows.
    rows = 2 if _arch.is_gpu(out.device) else 64
    num_rows = num_tokens * num_heads
    lse_arg = lse if lse is not None else part_lse
    _merge_kernel[(triton.cdiv(num_rows, rows),)](
        part_o, part_lse, out, lse_arg,
        num_rows, num_heads, num_states,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        *lse_strides(lse),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=block_states, ROWS=rows, WRITE_LSE=lse is not None,
        num_warps=4,
    )


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor,  # [T, H, D], [T, H]: attention over key set A
    o_b: torch.Tensor, lse_b: torch.Tensor,  # the same over a disjoint key set B
    out: torch.Tensor,  # [T, H, D]: attention over A and B together
    lse_out: torch.Tensor | None = None,
) -> None:
    """Two-state merge (FlashInfer's `merge_state`), through the same kernel."""
    part_o = torch.stack([o_a.float(), o_b.float()], dim=2)
    part_lse = torch.stack([lse_a.float(), lse_b.float()], dim=2)
    merge_partials(part_o, part_lse, out, lse_out)


class PartialScratch:
    """Preallocated float32 space for partial states, so split launches allocate nothing and
    keep fixed addresses (a requirement for CUDA graph capture). The backend owns one."""

    def __init__(self, num_floats: int, device: torch.device | str) -> None:
        if num_floats < 16:
            raise ValueError(f"PartialScratch needs at least 16 floats, got {num_floats}")
        self.o = torch.empty(num_floats, dtype=torch.float32, device=device)
        self.lse = torch.empty(num_floats // 16, dtype=torch.float32, device=device)

    def max_states(self, tokens: int, heads: int, head_dim: int) -> int:
        rows = max(tokens * heads, 1)
        return min(self.o.numel() // (rows * head_dim), self.lse.numel() // rows)

    def views(
        self, tokens: int, heads: int, states: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if states > self.max_states(tokens, heads, head_dim):
            raise ValueError(f"{states} partial states of {tokens}x{heads} rows exceed the scratch")
        n = tokens * heads * states
        part_o = self.o[: n * head_dim].view(tokens, heads, states, head_dim)
        return part_o, self.lse[:n].view(tokens, heads, states)


def partial_buffers(
    scratch: PartialScratch | None, tokens: int, heads: int, states: int, head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views into `scratch` if given, else fresh tensors (tests and one-off calls)."""
    if scratch is not None:
        return scratch.views(tokens, heads, states, head_dim)
    return (
        torch.empty(tokens, heads, states, head_dim, dtype=torch.float32, device=device),
        torch.empty(tokens, heads, states, dtype=torch.float32, device=device),
    )


def lse_strides(lse: torch.Tensor | None) -> tuple[int, int]:
    return (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)


def partial_strides(part_o: torch.Tensor, part_lse: torch.Tensor, used: bool) -> tuple[int, ...]:
    """The five partial-state strides a kernel takes; zeros when it writes final outputs."""
    if not used:
        return (0, 0, 0, 0, 0)
    return (part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1))


settle_cache_keys(globals())  # _keys.py: the same cache keys in every process
