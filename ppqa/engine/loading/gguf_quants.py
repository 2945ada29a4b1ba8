"""GGUF's plain and most common block types dequantized with torch, on the weights' device.

`gguf.quants` dequantizes in numpy on the CPU, ~8 ns a weight (SmolLM2's 135M Q4_1 weights:
1.06 s of a CPU worker's start, benchmarks/NOTES.md "CPU: a GGUF model's start-up"), which
would be about a minute for an 8B model. Here the raw blocks go to the target device as bytes
and unpack there, with the same float32 arithmetic in the same order as `gguf.quants` (a
multiply, then an add), so the results are the same bits (tests/test_loader_gguf.py). The bytes
come either from the memory-mapped file, a chunk at a time (`dequantize`: the CPU's path), or
as the whole tensor already on the device (`dequantize_bytes`: a GPU's, read there through
`streaming.stream_runs` by engine/loading/gguf.py); both unpack alike (`_unpack`). Types not
listed in `TYPES` (Q5_0/Q5_1, Q2_K, Q3_K, the IQ types and the rest) return None and stay with
`gguf.quants`.

Block layouts (ggml, little-endian), 32 weights a block:
    Q8_0  f16 scale d, 32 int8 q:              w = d * q
    Q4_0  f16 scale d, 16 bytes of nibbles:    w = d * (q - 8)
    Q4_1  f16 scale d, f16 min m, 16 bytes:    w = d * q + m
where weight j < 16 is the low nibble of byte j and weight 16 + j its high nibble. The k-quants
(llama.cpp's Q4_K_M and Q5_K_M files are mostly these) hold 256 weights a block in 8 or 16
sub-blocks with scales of their own:
    Q4_K  f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes of nibbles:
          w = (d * scale) * q - dmin * min; bytes 32c..32c+31 hold sub-block 2c in their low
          nibbles and 2c + 1 in their high ones
    Q5_K  as Q4_K, with a fifth bit: bit s of byte j of 32 more bytes, for weight j of sub-block s
    Q6_K  128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d:
          w = (d * scale) * (q - 32), 16 sub-blocks of 16
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Blocks unpack a chunk at a time into the output: on the CPU the chunk's temporaries then stay
# in cache (whole 4096 x 4096 tensors unpack slower than numpy, chunks of 2^18 weights faster:
# benchmarks/NOTES.md, "CPU: a GGUF model's start-up"), and on a GPU a large tensor (a 128k
# vocabulary's embedding) needs no temporaries several times its size.
CPU_CHUNK_WEIGHTS = 1 << 18
DEVICE_CHUNK_WEIGHTS = 1 << 24


def dequantize(data: np.ndarray, kind, shape: tuple[int, ...],
               device: torch.device) -> torch.Tensor | None:
    """A tensor of `kind` (gguf.GGMLQuantizationType) held in `data` (the file's view: elements,
    or bytes of blocks) as float32 `shape` on `device`; None for a type not in TYPES. Each
    chunk's bytes go to `device` on their own (`.to`, from the memory map)."""
    if kind.name not in TYPES:
        return None
    flat = data.reshape(-1).view(np.uint8)
    return _unpack(kind.name, flat.size, shape, torch.device(device),
                   lambda begin, end: _bytes_on(flat[begin:end], device))


def dequantize_bytes(raw: torch.Tensor, kind, shape: tuple[int, ...]) -> torch.Tensor:
    """The same from the tensor's bytes already on their device (uint8, flat, as
    `streaming.stream_runs` delivers them), for a `kind` in TYPES."""
    return _unpack(kind.name, raw.numel(), shape, raw.device, lambda begin, end: raw[begin:end])


def _unpack(name: str, nbytes: int, shape: tuple[int, ...], device: torch.device,
            take: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """`take(begin, end)`: bytes begin..end of the tensor as uint8 on `device`."""
    if name in _PLAIN:
        return take(0, nbytes).view(_PLAIN[name]).float().reshape(shape)
    weights, size, unpack = _BLOCKS[name]
    blocks = nbytes // size
    out = torch.empty(blocks * weights, dtype=torch.float32, device=device)
    chunk = CPU_CHUNK_WEIGHTS if device.type == "cpu" else DEVICE_CHUNK_WEIGHTS
    step = max(1, chunk // weights)
    for first in range(0, blocks, step):
        last = min(blocks, first + step)
        raw = take(first * size, last * size).reshape(last - first, size)
        out[first * weights:last * weights] = unpack(raw).reshape(-1)
    return out.reshape(shape)


def _bytes_on(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    with warnings.catch_warnings():  # the memory map is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat).to(device)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the low nibbles, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return (_f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]).float()) + _f16(blocks[:, 2:4])


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _bits(raw: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """[n, g, b] bytes -> [n, g * len(shifts), b]: (byte >> shift) & mask, a row per shift
    after each group's rows of the shifts before."""
    return torch.stack([(raw >> s) & mask for s in shifts], dim=2).flatten(1, 2)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 sub-blocks' scales and mins, (d * scale, dmin * min) [n, 8, 1]."""
    a, b, c = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    scale = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1).float()
    low = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=1).float()
    return (_f16(blocks[:, 0:2]) * scale)[..., None], (_f16(blocks[:, 2:4]) * low)[..., None]


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    q = _bits(blocks[:, 16:].reshape(-1, 4, 32), (0, 4), 0x0F).float()
    return d * q - dm


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(blocks)
    low = _bits(blocks[:, 48:].reshape(-1, 4, 32), (0, 4), 0x0F)
    high = _bits(blocks[:, 16:48].reshape(-1, 1, 32), tuple(range(8)), 0x01)
    return d * (low | (high << 4)).float() - dm


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, 208:210]) * scale)[..., None]
    low = _bits(blocks[:, :128].reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    return d * q


# (weights, bytes, unpack) of a block
_BLOCKS = {"Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1),
           "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k)}
