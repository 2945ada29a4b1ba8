"""Dense float64 attention under an explicit boolean mask: the core of every `<op>_ref`.

The kernels' references build a [queries, keys] mask from the same rule the kernel evaluates
(stream rule, causality, row bounds) and call `masked_attention_ref`; tests compare kernels
against that. Slow and simple on purpose.
"""

from __future__ import annotations

import torch


def masked_attention_ref(
    q: torch.Tensor,  # [M, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    mask: torch.Tensor,  # [M, N] bool: query m may see key n
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [M, Hq, D] float64, lse [M, Hq] float64, natural log).

    A query that sees no key gets o = 0 and lse = -inf, the same convention the kernels use.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    q64 = q.double().transpose(0, 1)  # [Hq, M, D]
    k64 = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, D]
    v64 = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q64, k64.transpose(1, 2)) * sm_scale  # [Hq, M, N]
    scores = scores.masked_fill(~mask.to(scores.device)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, M]
    seen = torch.isfinite(lse)
    probs = torch.where(seen[..., None], torch.exp(scores - lse[..., None]), 0.0)
    out = torch.matmul(probs, v64)  # [Hq, M, D]
    return out.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()


def combine_states_ref(
    states: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partial (o, lse) pairs computed over disjoint key sets, in float64."""
    lses = torch.stack([lse.double() for _, lse in states])  # [S, ...]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.where(torch.isfinite(total), torch.exp(lses - total), 0.0)
    out = sum(w[..., None] * o.double() for w, (o, _) in zip(weights, states))
    return out, total
