"""Torch's cuDNN attention for a document's prefill chunks, exact attention at the matrix
units' rate where the extend kernel runs these shapes slower (benchmarks/RESULTS.md,
"Prefill"). `TritonBackend` sends a document's first chunk to cuDNN or to our causal kernel
(`kernels/causal_prefill.py`; `triton_first` chooses per row class) and a later chunk of a
document held in one slot run here (`chunk_attention`: two cuDNN calls with their
log-sum-exp, merged). bf16/fp16 on a GPU only (`fusable`); every caller falls back to the
Triton kernels where cuDNN refuses a shape.
"""

from __future__ import annotations

import torch

from ppqa.kernels.merge import merge_attention_states

# A later document chunk's rows are padded to a multiple of this in cuDNN's attention
# (chunk_attention): cuDNN builds a plan per shape, ~40 ms each.
CHUNK_ROWS = 512

# A first chunk's causal attention: our kernel plans nothing (one compiled variant serves every
# length) and runs at 460-510 TFLOP/s from 5.7k to 16k tokens on an H100 (FlashAttention
# 230-325; results/h100/first_chunk_s36c3.json); cuDNN runs at ~580 on the H200 once it holds
# a plan for the shape, which takes 38-51 ms to build (benchmarks/RESULTS.md, "A first
# chunk's length"; results/h200/sdpa_lengths_s14c1.json).
TRITON_CAUSAL_FLOPS = 480e12
CUDNN_CAUSAL_FLOPS = 580e12
CUDNN_PLAN_SECONDS = 0.045
# Per first-chunk row class (rows padded to CHUNK_ROWS, heads, KV heads, head size, dtype,
# device) run in this process: the seconds our kernel's calls have cost over cuDNN's rate;
# None once cuDNN takes it.
_CAUSAL_TRITON_LOSS: dict[tuple, float | None] = {}


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    """Matrix FLOPs of causal attention over `tokens` rows: QK^T and PV over half a square."""
    return 2.0 * tokens * tokens * heads * head_dim


def first_chunk_class(rows: int, heads: int, head_dim: int) -> tuple[int, float]:
    """A first chunk's square of `rows` rows: its row class (the rows cuDNN runs, padded to a
    multiple of CHUNK_ROWS) and the seconds our kernel at the exact rows takes over cuDNN at
    the padded ones, at their rates (negative where the padding costs more)."""
    padded = -(-rows // CHUNK_ROWS) * CHUNK_ROWS
    return padded, (causal_flops(rows, heads, head_dim) / TRITON_CAUSAL_FLOPS
                    - causal_flops(padded, heads, head_dim) / CUDNN_CAUSAL_FLOPS)


def triton_first(row_class: tuple, loss: float) -> bool:
    """Whether this first chunk of a row class goes to our kernel before cuDNN; `loss` is the
    seconds ours takes over cuDNN on it (cuDNN's rows padded to the class). A class runs
    through our kernel until what that has cost adds up to one of cuDNN's plans, then through
    cuDNN for good (rent until the rent paid equals the price: at most twice the best choice
    made knowing how often the class comes). A chunk whose padding costs cuDNN more than its
    rate gains (loss <= 0) runs ours whatever its class chose. A 16k chunk of a 7B model pays
    within its first two documents; a 5.7k-token document of Qwen2.5-7B loses under a
    millisecond over its 28 layers, so its class goes to cuDNN only after tens of documents."""
    if loss <= 0:
        return True
    lost = _CAUSAL_TRITON_LOSS.get(row_class, 0.0)
    if lost is None:
        return False
    if lost >= CUDNN_PLAN_SECONDS:
        _CAUSAL_TRITON_LOSS[row_class] = None
        return False
    _CAUSAL_TRITON_LOSS[row_class] = lost + loss
    return True


def fusable(q: torch.Tensor) -> bool:
    """The fused first-chunk paths (cuDNN, our causal kernel) take bf16/fp16 on a GPU only."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cuda"


def chunk_attention(q, k, v, k_earlier, v_earlier, o, scale: float, attend=None) -> None:
    """Attention of a document chunk's queries q [T, H, D] over the document's earlier tokens
    (k_earlier/v_earlier [P, Hkv, D], every key visible) and the chunk's own (k/v [T, Hkv, D],
    causal), into o [T, H, D]: each part by `attend` (default cuDNN, `cudnn_attention`) with
    its log-sum-exp, merged. cuDNN builds a plan per shape and a document's last chunk has a
    length of its own (~40 ms a plan, results/h200/prefill_chunks_s14c6.json), so the chunk's
    rows are padded to a multiple of CHUNK_ROWS with zeros, which no real row sees (causal)
    and whose outputs are dropped; P, the unmasked part's keys, stays exact.
    A short P (at most CHUNK_ROWS: a document that starts with a cached one's first tokens, a
    template's opening) varies from document to document and would cost a plan each (50-100
    ms the GPU idles, results/h200/gprof_quality_auto_s21c3.json, `cudnn_calls`); there the
    chunk is one causal call over P + T keys instead, the P earlier rows' queries zeros and
    their outputs dropped, so the padded total is the plan's only length (P = 0: a document's
    first tokens; `TritonBackend._first_chunk` chooses between this and our causal kernel)."""
    attend = attend or cudnn_attention
    group = q.shape[1] // k.shape[1]
    tokens, prior = q.shape[0], k_earlier.shape[0]
    if prior <= CHUNK_ROWS:
        rows = -(-(prior + tokens) // CHUNK_ROWS) * CHUNK_ROWS
        qh = heads_first(torch.cat([q.new_zeros((prior,) + q.shape[1:]), q]), rows=rows)
        whole, _ = attend(qh, heads_first(torch.cat([k_earlier, k]), group, rows),
                          heads_first(torch.cat([v_earlier, v]), group, rows),
                          causal=True, scale=scale)
        o.copy_(whole[prior:prior + tokens])
        return
    rows = -(-tokens // CHUNK_ROWS) * CHUNK_ROWS
    qh = heads_first(q, rows=rows)
    o_a, lse_a = attend(qh, heads_first(k_earlier, group), heads_first(v_earlier, group),
                        causal=False, scale=scale)
    o_b, lse_b = attend(qh, heads_first(k, group, rows), heads_first(v, group, rows),
                        causal=True, scale=scale)
    merge_attention_states(o_a[:tokens], lse_a[:tokens], o_b[:tokens], lse_b[:tokens], o)


def heads_first(x: torch.Tensor, group: int = 1, rows: int | None = None) -> torch.Tensor:
    """[T, Hx, D] -> [1, Hx * group, rows, D], heads first: each head repeated `group` times
    (a KV head for the query heads that share it), rows past T (if `rows` > T) zeros."""
    if group > 1:
        x = x.repeat_interleave(group, dim=1)
    if rows is not None and rows > x.shape[0]:
        x = torch.cat([x, x.new_zeros((rows - x.shape[0],) + x.shape[1:])])
    return x.unsqueeze(0).transpose(1, 2)


def cudnn_attention(q, k, v, *, causal: bool, scale: float):
    """Torch's cuDNN attention with the log-sum-exp: q [1, H, T, D], k/v [1, H, S, D] ->
    (o [T, H, D], lse [T, H] float32, natural log). Raises RuntimeError where cuDNN does not
    take the shapes."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    o, lse = out[0], out[1]
    tokens = q.shape[2]
    return o[0].transpose(0, 1), lse.reshape(q.shape[1], tokens).transpose(0, 1).float()
