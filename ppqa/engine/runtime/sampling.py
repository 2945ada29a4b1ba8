"""Sampling: one token per logit row, greedy or temperature / top-k / top-p, per-question seeds.

Randomness is counter based: the uniform noise of row r over the vocabulary is a hash of
(seed_r, step_r, token id), where step_r is how many tokens that question has sampled so far. A
question's answer therefore depends only on its own seed and logits, never on which other questions
share its batch, in which order, or in which mode (stock, parallel, cascade) it runs, and the same
noise comes out on the CPU and on a GPU. Sampling uses the Gumbel-max trick on the filtered logits.

A row under a grammar (a JSON schema, runtime/grammar.py) has the tokens its grammar forbids set
to -inf first (`apply_token_bitmask`), so every sampler, greedy included, picks an allowed one.

Data flow: the scheduler concatenates the [P] parameter tensors of the step's requests into a
`SamplingBatch` (with the step's constrained rows, if any); the runner's logits [R, V] and that
batch go into `sample`, the tokens [R] go back to the scheduler. Nothing here waits for the
device: host tensors reach a GPU from page-locked memory, asynchronously, so that the engine can
prepare the next step while this one runs (engine/session.py).
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
    # The step's constrained rows (runtime/grammar.GrammarRows), masked before sampling.
    grammar: object | None = None

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


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for it: a plain copy to a GPU from pageable
    memory synchronizes with the device, which would stall the host behind the step in flight."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: host tensor [R] (0 = off); keeps each row's k largest logits (and ties)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kmax = int(k.max())
    kth = logits.topk(kmax, dim=-1).values.gather(1, _to_device(k - 1, logits.device).view(-1, 1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token; the top token always stays
    ordered = ordered.masked_fill(before > top_p.view(-1, 1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}  # 0..7 as uint8, per device


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf for every token the bitmask forbids (a new tensor: the runner's may be
    a graph's static output or an inference tensor).

    bitmask: [R, ceil(V / 32)] int32, host or device, bit b of word w allowing token 32 w + b
    (the layout every grammar library writes). Read as little-endian bytes, byte m holds tokens
    8 m .. 8 m + 7: shifting each byte by 0..7 and keeping the low bit unpacks it into 0/1
    bytes, which are read as bools, with no per-token loop.
    Columns past the mask's 32 * words (a model vocabulary padded beyond it) are forbidden too.
    """
    rows, vocab = logits.shape
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    if bitmask.device != device:
        bitmask = bitmask.to(device, non_blocking=True)  # asynchronous from pinned memory
    packed = bitmask.contiguous().view(torch.uint8)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(torch.bool)
    allowed = allowed.view(rows, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(rows, vocab - allowed.shape[1])], dim=1)
    return torch.where(allowed[:, :vocab], logits, float("-inf"))


FILL = object()  # `sample`'s default bitmask: fill it now


def sample(logits: torch.Tensor, batch: SamplingBatch, bitmask=FILL) -> torch.Tensor:
    """logits [R, V] (float32) -> token ids [R] int64 on the logits' device. Rows under a
    grammar are masked first, by `bitmask` when the caller filled it already (None: no row
    left to mask), else by masks filled now from the matchers as they stand."""
    if batch.grammar is not None:
        if bitmask is FILL:
            bitmask = batch.grammar.bitmask(*logits.shape, pin=logits.is_cuda)
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    device = logits.device
    # Filters are decided from the host copies: no device synchronization.
    use_top_k, use_top_p = bool((batch.top_k > 0).any()), bool((batch.top_p < 1.0).any())
    temperature = _to_device(batch.temperature, device)
    scaled = logits / temperature.clamp(min=1e-5).view(-1, 1)
    if use_top_k:
        scaled = _filter_top_k(scaled, batch.top_k)
    if use_top_p:
        scaled = _filter_top_p(scaled, _to_device(batch.top_p, device))
    uniform = counter_uniform(_to_device(batch.seed, device), _to_device(batch.step, device),
                              logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
