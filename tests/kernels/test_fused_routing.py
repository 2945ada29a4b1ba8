"""How `TritonBackend` routes a document's prefill chunks to torch's fused attention
(`fused_chunks`), on the CPU: which backend takes a first chunk, what falls back when one
refuses, and that the padding, the copied-opening square and the later chunk's two parts with
their merge give causal attention. cuDNN and FlashAttention run only on a GPU, so here each is
stood in by a float64 attention with its log-sum-exp that records the shapes it was handed (or
refuses, as they do with shapes they do not take); tests/gpu/test_fused_causal.py runs the
real ones."""

from __future__ import annotations

import pytest
import torch
from checks import ATOL, DEVICE, HEADS
from torch.nn.attention import SDPBackend

from ppqa.engine.attention import fused_chunks, triton_backend
from ppqa.engine.attention.fused_chunks import CHUNK_ROWS
from ppqa.engine.attention.triton_backend import TritonBackend
from ppqa.engine.runtime.kv_cache import KVPool


def refuse(*args, **kwargs):
    raise RuntimeError("no kernel for these shapes")


def reference_with_lse(q, k, v, *, causal: bool, scale: float):
    """cuDNN's contract (`fused_chunks.cudnn_attention`) in float64: q [1, H, T, D], k/v
    [1, H, S, D] -> (o [T, H, D], lse [T, H] float32); causal means T == S, lower triangle."""
    s = torch.einsum("htd,hsd->hts", q[0].double(), k[0].double()) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hts,hsd->htd", torch.exp(s - lse[..., None]), v[0].double())
    return o.transpose(0, 1).float(), lse.transpose(0, 1).float()


def causal_reference(q, k, v, scale: float) -> torch.Tensor:
    """q [T, H, D] over k/v [T, Hkv, D], causal, float64 -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    heads = [x.transpose(0, 1).unsqueeze(0) for x in
             (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
    return reference_with_lse(*heads, causal=True, scale=scale)[0].double()


class Recorder:
    """A stand-in fused backend: the reference, or a refusal; records (causal, rows, keys)."""

    def __init__(self, works: bool = True):
        self.works, self.calls = works, []

    def cudnn(self, q, k, v, *, causal, scale):
        self.calls.append((causal, q.shape[2], k.shape[2]))
        if not self.works:
            refuse()
        return reference_with_lse(q, k, v, causal=causal, scale=scale)

    def flash(self, q, k, v, k_prior, v_prior, o, scale):
        self.calls.append((True, k_prior.shape[0] + q.shape[0], k_prior.shape[0] + k.shape[0]))
        if not self.works:
            refuse()
        whole = causal_reference(torch.cat([q.new_zeros((k_prior.shape[0],) + q.shape[1:]), q]),
                                 torch.cat([k_prior, k]), torch.cat([v_prior, v]), scale)
        o.copy_(whole[k_prior.shape[0]:])


@pytest.fixture
def routed(monkeypatch):
    """(backend maker, cuDNN stand-in, FlashAttention stand-in) with fp32 tensors taken as
    fusable and the first-chunk rent reset."""
    cudnn, flash = Recorder(), Recorder()
    monkeypatch.setattr(triton_backend, "fusable", lambda q: True)
    monkeypatch.setattr(fused_chunks, "cudnn_attention", cudnn.cudnn)
    monkeypatch.setattr(triton_backend, "flash_causal", flash.flash)
    monkeypatch.setattr(fused_chunks, "_CAUSAL_FLASH_LOSS", {})

    def make(heads):
        num_heads, kv_heads, dim = heads
        pool = KVPool(CHUNK_ROWS + 128, 1, kv_heads, dim, dtype=torch.float32,
                      device=DEVICE)
        return TritonBackend(pool, num_heads, kv_heads, dim, dim ** -0.5,
                             scratch_bytes=1 << 20)
    return make, cudnn, flash


def inputs(tokens: int, heads, seed: int = 0):
    num_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, h, dim, generator=gen).to(DEVICE)
                 for h in (num_heads, kv_heads, kv_heads))


def assert_causal(got, q, k, v, scale, skip: int = 0):
    ref = causal_reference(q, k, v, scale)[skip:]
    assert torch.isfinite(got).all()
    assert (got.double() - ref).abs().max() <= ATOL[torch.float32]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_first_chunk_takes_flash_then_cudnn_when_flash_refuses(heads, routed):
    make, cudnn, flash = routed
    backend = make(heads)
    q, k, v = inputs(40, heads)
    o = torch.full_like(q, float("nan"))
    # 40 rows padded to 512 cost cuDNN more than its rate gains: FlashAttention first.
    assert backend._first_chunk(q, k, v, o)
    assert backend.causal_backend_used == SDPBackend.FLASH_ATTENTION and cudnn.calls == []
    assert flash.calls == [(True, 40, 40)]
    assert_causal(o, q, k, v, backend.sm_scale)
    # FlashAttention refusing a shape drops it for good; cuDNN runs the rows padded.
    flash.works = False
    o = torch.full_like(q, float("nan"))
    assert backend._first_chunk(q, k, v, o)
    assert backend.causal_backend_used == SDPBackend.CUDNN_ATTENTION
    assert cudnn.calls == [(True, CHUNK_ROWS, CHUNK_ROWS)]
    assert SDPBackend.FLASH_ATTENTION not in backend._causal_backends
    assert_causal(o, q, k, v, backend.sm_scale)
    assert backend._first_chunk(q, k, v, torch.empty_like(q))
    assert len(flash.calls) == 2  # not asked again


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_first_chunk_after_a_copied_opening_is_one_padded_causal_square(heads, routed):
    """A short prior (a template's opening copied from a cached document): one causal call over
    prior + chunk rows, padded to a multiple of CHUNK_ROWS, the prior rows' outputs dropped."""
    make, cudnn, flash = routed
    flash.works = False
    backend = make(heads)
    prior, tokens = 59, 500
    q, k, v = inputs(prior + tokens, heads, seed=1)
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._first_chunk(q[prior:], k[prior:], v[prior:], o, k[:prior], v[:prior])
    assert cudnn.calls == [(True, 2 * CHUNK_ROWS, 2 * CHUNK_ROWS)]
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)


def test_no_fused_backend_leaves_the_chunk_to_the_extend_kernel(routed):
    make, cudnn, flash = routed
    cudnn.works = flash.works = False
    backend = make(HEADS[0])
    q, k, v = inputs(40, HEADS[0])
    assert not backend._first_chunk(q, k, v, torch.empty_like(q))
    assert backend._causal_backends == ()
    asked = len(cudnn.calls) + len(flash.calls)
    assert asked == 2
    assert not backend._first_chunk(q, k, v, torch.empty_like(q))
    assert len(cudnn.calls) + len(flash.calls) == asked  # neither asked again


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_later_chunk_reads_its_earlier_tokens_from_the_pool_in_two_merged_parts(heads,
                                                                                  routed):
    """After more than CHUNK_ROWS earlier tokens in one slot run, a chunk is two cuDNN calls
    (the earlier keys unmasked, exact; the chunk's own causal, its rows padded), merged by
    their log-sum-exp; where cuDNN refuses, the chunk is left to the extend kernel."""
    make, cudnn, flash = routed
    backend = make(heads)
    first_slot, prior, tokens = 7, CHUNK_ROWS + 88, 30
    q, k, v = inputs(prior + tokens, heads, seed=2)
    k_buf, v_buf = backend.pool.k_buffers[0], backend.pool.v_buffers[0]
    k_buf[first_slot:first_slot + prior], v_buf[first_slot:first_slot + prior] = k[:prior], v[:prior]
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf, first_slot,
                                prior)
    assert backend._chunk_ok and flash.calls == []
    assert sorted(cudnn.calls) == [(False, CHUNK_ROWS, prior), (True, CHUNK_ROWS, CHUNK_ROWS)]
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)
    cudnn.works = False
    assert not backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf,
                                    first_slot, prior)
    assert backend._chunk_ok is False


def test_a_later_chunk_after_a_short_prior_goes_as_a_first_chunk(routed):
    make, cudnn, flash = routed
    backend = make(HEADS[1])
    prior, tokens = 100, 60
    q, k, v = inputs(prior + tokens, HEADS[1], seed=3)
    k_buf, v_buf = backend.pool.k_buffers[0], backend.pool.v_buffers[0]
    k_buf[:prior], v_buf[:prior] = k[:prior], v[:prior]
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf, 0, prior)
    assert flash.calls == [(True, prior + tokens, prior + tokens)] and cudnn.calls == []
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)


def test_cudnn_attention_refuses_what_cudnn_cannot_run_as_the_backend_expects():
    """On CPU tensors torch has the op but no kernel: a RuntimeError, which the backend takes
    as cuDNN's refusal. (A misnamed op would raise AttributeError and fail the prefill.)"""
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="_scaled_dot_product_cudnn_attention"):
        fused_chunks.cudnn_attention(q, q, q, causal=True, scale=0.25)
