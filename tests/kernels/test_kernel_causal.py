"""The causal kernel of a document's first prefill chunk (ppqa/kernels/causal.py) against the
float64 reference: chunk lengths that are not a multiple of the tile, P earlier keys before
the chunk, groups of 1, 4 and 7 query heads per KV head, heads of 64 and 128, whole key tiles
through pointer loads and through tensor descriptors (TMA), views of one packed qkv tensor, and
tiles other than the default (larger than the chunk too)."""

import math

import pytest
import torch
from checks import DEVICE, DTYPES, ON_GPU, assert_close_to_ref, case_id, poisoned

from ppqa.kernels._arch import Tiles
from ppqa.kernels._ref import masked_attention_ref
from ppqa.kernels.causal import causal_attention, causal_attention_ref

# (chunk tokens T, earlier keys P, (query heads, KV heads), head_dim)
CASES = [
    (1, 0, (4, 4), 64),
    (1, 40, (7, 1), 128),
    (37, 0, (8, 2), 128),
    (37, 5, (7, 1), 64),
    (37, 30, (4, 4), 64),  # each tile's first row 2 keys short of a key tile's end (16, 32)
    (100, 40, (4, 4), 128),
    (100, 0, (7, 1), 64),
    (100, 5, (8, 2), 64),
] + ([(2085, 0, (28, 4), 128), (1000, 300, (32, 32), 128)] if ON_GPU else [])
KERNEL_DTYPES = DTYPES if ON_GPU else [torch.float32, torch.bfloat16]
# (dtype, key scale): keys scaled by 64 make a row's running maximum jump far between key
# tiles, so an exponent taken against a stale maximum would overflow (float32: exact).
SCALES = [(dtype, 1.0) for dtype in KERNEL_DTYPES] + [(torch.float32, 64.0)]
# Tiles other than causal_tiles' default: keys tiles longer and shorter than query tiles, and
# tiles longer than the CPU cases' chunks.
TILES = [Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(128, 128, 8, 2)]
TILE_DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def case_name(case) -> str:
    tokens, prior, (heads, kv_heads), head_dim = case
    return f"T{tokens}-P{prior}-{heads}x{kv_heads}x{head_dim}"


def inputs(case, dtype, gen, sharp=1.0, packed=False):
    """q [T, H, D] and k, v [P + T, Hkv, D], random. packed: views split from one [P + T,
    (H + 2 Hkv) x D] tensor, as a model's qkv projection gives them (q from its last T rows)."""
    tokens, prior, (heads, kv_heads), head_dim = case
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(prior + tokens, sum(widths), generator=gen)
    qkv[:, widths[0]:widths[0] + widths[1]] *= sharp
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = (x.view(prior + tokens, -1, head_dim) for x in qkv.split(widths, dim=1))
    q = q[prior:]
    if not packed:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return q, k, v


def check(case, dtype, q, k, v, o, tiles=None, runs=(False, True)):
    """Runs the kernel with pointer loads and with TMA tiles into o (poisoned first) and
    compares o with the reference."""
    scale = 1 / math.sqrt(q.shape[2])
    ref = causal_attention_ref(q, k, v, scale)
    for tma in runs:
        o.fill_(float("nan"))
        causal_attention(q, k, v, o, scale, tiles=tiles, tma=tma)
        assert_close_to_ref(o, ref, dtype, f"{case_name(case)} tiles={tiles} tma={tma}")


@pytest.mark.parametrize("dtype,sharp", SCALES, ids=lambda v: case_id(v) if v != 1.0 else "")
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_causal_matches_reference(case, dtype, sharp):
    gen = torch.Generator().manual_seed(case[0] * 131 + case[1])
    q, k, v = inputs(case, dtype, gen, sharp)
    check(case, dtype, q, k, v, poisoned(q.shape, dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=case_id)
@pytest.mark.parametrize("case", [(37, 40, (7, 1), 64), (100, 5, (8, 2), 128)], ids=case_name)
def test_packed_views_and_strided_output(case, dtype):
    """q, k, v split from one packed tensor (strided rows), o a view of a wider, longer buffer:
    every element of o is written and nothing of the buffer around it."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = inputs(case, dtype, gen, packed=True)
    tokens, heads, head_dim = q.shape
    buffer = poisoned((tokens + 3, heads + 2, head_dim), dtype)
    o = buffer[:tokens, 1:heads + 1]
    check(case, dtype, q, k, v, o)
    around = torch.cat([buffer[tokens:].flatten(), buffer[:, 0].flatten(),
                        buffer[:, heads + 1].flatten()])
    assert torch.isnan(around).all(), "the kernel wrote outside o"


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t.block_m}x{t.block_n}x{t.num_warps}")
@pytest.mark.parametrize("case", [(37, 5, (8, 2), 64), (100, 40, (7, 1), 128)], ids=case_name)
def test_other_tiles(case, tiles):
    gen = torch.Generator().manual_seed(11)
    q, k, v = inputs(case, TILE_DTYPE, gen)
    check(case, TILE_DTYPE, q, k, v, poisoned(q.shape, TILE_DTYPE), tiles)


def test_reference_is_lower_right_causal():
    """Query i of the chunk sees exactly the keys 0..P+i: each row of the reference equals
    unmasked attention over those keys alone."""
    tokens, prior = 9, 4
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs((tokens, prior, (6, 2), 16), torch.float32, gen)
    ref = causal_attention_ref(q, k, v, 0.25)
    for i in range(tokens):
        keys = prior + i + 1
        row, _ = masked_attention_ref(q[i:i + 1], k[:keys], v[:keys],
                                      torch.ones(1, keys, dtype=torch.bool), 0.25)
        torch.testing.assert_close(ref[i], row[0].cpu(), rtol=0, atol=1e-12)


def test_rejects_fewer_keys_than_queries():
    q = torch.zeros(5, 2, 16, device=DEVICE)
    k = torch.zeros(4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="N >= T"):
        causal_attention(q, k, k, q.clone(), 1.0)
