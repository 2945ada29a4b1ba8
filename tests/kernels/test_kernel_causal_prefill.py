"""The causal prefill kernel (`kernels/causal_prefill.py`) against its float64 reference: lengths
that leave partial tiles, earlier positions before the queries, grouped-query heads, views split
from one packed qkv, tiles wider than the sequence, whole key tiles through tensor descriptors
and through pointer loads."""

from __future__ import annotations

import pytest
import torch
from checks import DEVICE, ON_GPU, assert_close_to_ref, case_id, poisoned

from ppqa.kernels import _arch
from ppqa.kernels.causal_prefill import causal_attention, causal_attention_ref

# (num_heads, num_kv_heads, head_dim): a group of 1, of 4, of 7 (not a power of two).
HEADS = ([(32, 32, 128), (28, 4, 128)] if ON_GPU
         else [(4, 4, 16), (8, 2, 32), (7, 1, 16)])
# (tokens, earlier positions); in the last, a tile's first row sits two before a key tile's
# end (the default tiles: 16 x 32 here, 128 x 64 on a GPU), so its unmasked part stops a whole
# key tile short of the row.
LENGTHS = ([(1, 0), (300, 0), (2049, 0), (1000, 37), (700, 62)] if ON_GPU
           else [(1, 0), (37, 0), (70, 5), (45, 40), (40, 30)])


def packed(tokens: int, prior: int, heads, dtype, seed: int = 0):
    """q [T, H, D] and k, v [P + T, Hkv, D] as views split from one packed row each, as a
    layer's qkv projection gives them (token strides over all three)."""
    num_heads, num_kv_heads, dim = heads
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * dim
    rows = torch.randn(prior + tokens, width, generator=g).to(DEVICE, dtype)
    q = rows[prior:, :num_heads * dim].view(tokens, num_heads, dim)
    k = rows[:, num_heads * dim:(num_heads + num_kv_heads) * dim].view(-1, num_kv_heads, dim)
    v = rows[:, (num_heads + num_kv_heads) * dim:].view(-1, num_kv_heads, dim)
    return q, k, v


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=case_id)
@pytest.mark.parametrize("heads", HEADS, ids=case_id)
@pytest.mark.parametrize("length", LENGTHS, ids=case_id)
def test_causal_prefill_matches_the_reference(length, heads, dtype, tma):
    """Both key paths: whole tiles through tensor descriptors (the interpreter runs them too)
    and through pointer loads."""
    if tma and ON_GPU and not _arch.use_tma(DEVICE):
        pytest.skip("no tensor memory accelerator on this GPU")
    tokens, prior = length
    q, k, v = packed(tokens, prior, heads, dtype)
    o = poisoned(q.shape, dtype)
    scale = heads[2] ** -0.5
    causal_attention(q, k, v, o, scale, tma=tma)
    assert_close_to_ref(o, causal_attention_ref(q, k, v, scale).cpu(), dtype,
                        f"causal T={tokens} P={prior} {heads} tma={tma}")


def test_each_row_sees_exactly_its_causal_keys():
    """A key's value changes the rows that see it and no others: the mask is exact at every
    tile edge, not merely close on average (one-hot values make each key's weight visible)."""
    num_heads, num_kv_heads, dim = 2, 1, 32 if not ON_GPU else 128
    tokens, prior = 50, 3
    q, k, _ = packed(tokens, prior, (num_heads, num_kv_heads, dim), torch.float32)
    v = torch.zeros(prior + tokens, num_kv_heads, dim, device=DEVICE)
    v[:, 0, :] = torch.arange(prior + tokens, device=DEVICE, dtype=torch.float32)[:, None]
    q = torch.zeros_like(q)  # equal scores: each row averages the positions it sees
    o = poisoned(q.shape)
    causal_attention(q, k, v, o, 1.0)
    seen_mean = (torch.arange(tokens, device=DEVICE) + prior) / 2.0
    assert torch.allclose(o[:, :, 0].double().cpu(),
                          seen_mean.double().cpu()[:, None].expand(tokens, num_heads), atol=1e-4)


def test_tiles_wider_than_the_sequence_and_more_tiles_than_needed():
    heads = (4, 2, 32)
    q, k, v = packed(9, 2, heads, torch.float32, seed=3)
    ref = causal_attention_ref(q, k, v, 0.2).cpu()
    for tiles in (_arch.Tiles(64, 64, 4, 1), _arch.Tiles(16, 16, 4, 1)):
        o = poisoned(q.shape)
        causal_attention(q, k, v, o, 0.2, tiles=tiles)
        assert_close_to_ref(o, ref, torch.float32, f"tiles {tiles}")


def test_fewer_keys_than_queries_is_refused():
    q, k, v = packed(8, 0, (2, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="fewer than"):
        causal_attention(q, k[:4], v[:4], torch.empty_like(q), 1.0)


def test_a_strided_output_is_written_and_nothing_beside_it():
    """o as a view inside a larger buffer (its token stride over more heads): every element of
    the view written, within tolerance, and the buffer's other heads left as they were."""
    heads = (4, 2, 32)
    q, k, v = packed(37, 4, heads, torch.float32, seed=6)
    buffer = poisoned((37, heads[0] + 2, heads[2]))
    o = buffer[:, 1:heads[0] + 1]
    causal_attention(q, k, v, o, 0.3)
    assert_close_to_ref(o, causal_attention_ref(q, k, v, 0.3).cpu(), torch.float32, "strided o")
    assert torch.isnan(buffer[:, 0]).all() and torch.isnan(buffer[:, -1]).all()
