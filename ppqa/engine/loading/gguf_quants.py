"""GGUF's plain and most common block types dequantized with torch, on the weights' device.

`gguf.quants` dequantizes in numpy on the CPU, ~8 ns a weight (SmolLM2's 135M Q4_1 weights:
1.06 s of a CPU worker's start, benchmarks/NOTES.md "CPU: a GGUF model's start-up"), which
would be about a minute for an 8B model. Here the raw blocks go to the target device as bytes
and unpack there, with the same float32 arithmetic in the same order as `gguf.quants` (a
multiply, then an add), so the results are the same bits (tests/test_loader_gguf.py). Types
not listed in `TYPES` (the k-quants and the rest) return None and stay with `gguf.quants`.

Block layouts (ggml, little-endian), 32 weights a block:
    Q8_0  f16 scale d, 32 int8 q:              w = d * q
    Q4_0  f16 scale d, 16 bytes of nibbles:    w = d * (q - 8)
    Q4_1  f16 scale d, f16 min m, 16 bytes:    w = d * q + m
where weight j < 16 is the low nibble of byte j and weight 16 + j its high nibble.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HEADER_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}  # scale (and min) before the quants


def dequantize(data: np.ndarray, kind, shape: tuple[int, ...],
               device: torch.device) -> torch.Tensor | None:
    """A tensor of `kind` (gguf.GGMLQuantizationType) held in `data` (the file's view: elements,
    or bytes of blocks) as float32 `shape` on `device`; None for a type not in TYPES."""
    name = kind.name
    if name not in TYPES:
        return None
    with warnings.catch_warnings():  # the memory map is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data.reshape(-1).view(np.uint8)).to(device)
    if name in _PLAIN:
        return raw.view(_PLAIN[name]).float().reshape(shape)
    header = _HEADER_BYTES[name]
    blocks = raw.reshape(-1, header + (32 if name == "Q8_0" else 16))
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(shape)
    packed = blocks[:, header:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1)
    if name == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).reshape(shape)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return ((d * q.float()) + m).reshape(shape)
