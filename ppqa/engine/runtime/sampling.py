"""Sampling: one token per logit row, greedy or temperature / top-k / top-p, per-question seeds.

Randomness is counter based: the uniform noise of row r over the vocabulary is a hash of
(seed_r, step_r, token id), where step_r is how many tokens that question has sampled so far. A
question's answer therefore depends only on its own seed and logits, never on which other questions
share its batch, in which order, or in which mode (stock, parallel, cascade) it runs, and the same
noise comes out on the CPU and on a GPU. Sampling uses the Gumbel-max trick on the filtered logits.

Data flow: the scheduler concatenates the [P] parameter tensors of the step's requests into a
`SamplingBatch`; the runner's logits [R, V] and that batch go into `sample`, the tokens [R] go back
to the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    # Host (CPU) tensors; `sample` moves what it needs to the logits' device.
    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64; 0 = off
    seed: torch.Tensor  # [R] int64
    step: torch.Tensor  # [R] int64 tokens already sampled by the row's question
    all_greedy: bool = False

    def __post_init__(self) -> None:
        rows = self.temperature.shape[0]
        for name in ("top_p", "top_k", "seed", "step"):
            if getattr(self, name).shape != (rows,):
                raise ValueError(f"SamplingBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected ({rows},)")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply finalizer) of int64 tensors holding values < 2**32.

    Products may wrap around int64; only their low 32 bits are kept, which wrapping preserves.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, token id)."""
    seed = seed.to(torch.int64)
    row = _mix32(_mix32(seed ^ (seed >> 32)) ^ _mix32(step.to(torch.int64) + 0x3C6EF372))
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    bits = _mix32(row.view(-1, 1) + ids.view(1, -1) * 0x9E3779B9)
    # 23 bits, so that (bits + 0.5) is exact in float32 and the uniform never reaches 1.
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: host tensor [R] (0 = off); keeps each row's k largest logits (and ties)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kmax = int(k.max())
    kth = logits.topk(kmax, dim=-1).values.gather(1, (k - 1).view(-1, 1).to(logits.device))
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token; the top token always stays
    ordered = ordered.masked_fill(before > top_p.view(-1, 1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [R, V] (float32) -> token ids [R] int64 on the logits' device."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    device = logits.device
    # Filters are decided from the host copies: no device synchronization.
    use_top_k, use_top_p = bool((batch.top_k > 0).any()), bool((batch.top_p < 1.0).any())
    temperature = batch.temperature.to(device)
    scaled = logits / temperature.clamp(min=1e-5).view(-1, 1)
    if use_top_k:
        scaled = _filter_top_k(scaled, batch.top_k)
    if use_top_p:
        scaled = _filter_top_p(scaled, batch.top_p.to(device))
    uniform = counter_uniform(batch.seed.to(device), batch.step.to(device), logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
