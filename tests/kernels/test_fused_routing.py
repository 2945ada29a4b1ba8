"""How `TritonBackend` routes a document's prefill chunks to our causal kernel and to cuDNN
(`fused_chunks`), on the CPU: which path takes a first chunk, when a row class moves to cuDNN,
what runs when cuDNN refuses, and that the padding, the copied-opening square and the later
chunk's two parts with their merge give causal attention. Our kernel runs for real (Triton's
interpreter); cuDNN runs only on a GPU, so here it is stood in by a float64 attention with its
log-sum-exp that records the shapes it was handed (or refuses, as cuDNN does with shapes it
does not take); tests/gpu/test_fused_causal.py runs the real one."""

from __future__ import annotations

import pytest
import torch
from checks import ATOL, DEVICE, HEADS

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


@pytest.fixture
def routed(monkeypatch):
    """(backend maker, cuDNN stand-in) with fp32 tensors taken as fusable and the first-chunk
    rent reset."""
    cudnn = Recorder()
    monkeypatch.setattr(triton_backend, "fusable", lambda q: True)
    monkeypatch.setattr(fused_chunks, "cudnn_attention", cudnn.cudnn)
    monkeypatch.setattr(fused_chunks, "_CAUSAL_TRITON_LOSS", {})

    def make(heads):
        num_heads, kv_heads, dim = heads
        pool = KVPool(CHUNK_ROWS + 128, 1, kv_heads, dim, dtype=torch.float32,
                      device=DEVICE)
        return TritonBackend(pool, num_heads, kv_heads, dim, dim ** -0.5,
                             scratch_bytes=1 << 20)
    return make, cudnn


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
def test_a_first_chunk_takes_our_kernel_until_its_class_has_paid_cudnns_plan(heads, routed,
                                                                            monkeypatch):
    """A row class runs our kernel until what it has cost over cuDNN's rate adds up to one
    plan, then cuDNN (its rows padded to the class) for good; a chunk whose padding costs
    cuDNN more than its rate gains stays on ours."""
    make, cudnn = routed
    backend = make(heads)
    tokens = CHUNK_ROWS - 12
    _, loss = fused_chunks.first_chunk_class(tokens, heads[0], heads[2])
    assert loss > 0
    monkeypatch.setattr(fused_chunks, "CUDNN_PLAN_SECONDS", 1.5 * loss)
    q, k, v = inputs(tokens, heads)
    paths = []
    for _ in range(4):
        o = torch.full_like(q, float("nan"))
        assert backend._first_chunk(q, k, v, o)
        paths.append(backend.causal_path)
        assert_causal(o, q, k, v, backend.sm_scale)
    assert paths == ["triton", "triton", "cudnn", "cudnn"]
    assert cudnn.calls == [(True, CHUNK_ROWS, CHUNK_ROWS)] * 2
    q, k, v = inputs(40, heads, seed=4)  # 40 rows padded to 512: ours
    o = torch.full_like(q, float("nan"))
    assert backend._first_chunk(q, k, v, o)
    assert backend.causal_path == "triton" and len(cudnn.calls) == 2
    assert_causal(o, q, k, v, backend.sm_scale)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_first_chunk_after_a_copied_opening_is_one_causal_square(heads, routed,
                                                                   monkeypatch):
    """A short prior (a template's opening copied from a cached document): through cuDNN one
    causal call over prior + chunk rows, padded to a multiple of CHUNK_ROWS, the prior rows'
    outputs dropped; through our kernel the chunk's rows over prior + chunk keys."""
    make, cudnn = routed
    backend = make(heads)
    prior, tokens = 59, 450
    q, k, v = inputs(prior + tokens, heads, seed=1)
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._first_chunk(q[prior:], k[prior:], v[prior:], o, k[:prior], v[:prior])
    assert backend.causal_path == "triton" and cudnn.calls == []
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)
    monkeypatch.setattr(fused_chunks, "CUDNN_PLAN_SECONDS", 0.0)
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._first_chunk(q[prior:], k[prior:], v[prior:], o, k[:prior], v[:prior])
    assert backend.causal_path == "cudnn"
    assert cudnn.calls == [(True, CHUNK_ROWS, CHUNK_ROWS)]
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)


def test_where_cudnn_refuses_our_kernel_runs_and_cudnn_is_not_asked_again(routed, monkeypatch):
    make, cudnn = routed
    cudnn.works = False
    monkeypatch.setattr(fused_chunks, "CUDNN_PLAN_SECONDS", 0.0)  # cuDNN from the first call
    backend = make(HEADS[0])
    q, k, v = inputs(CHUNK_ROWS - 12, HEADS[0])
    for _ in range(2):
        o = torch.full_like(q, float("nan"))
        assert backend._first_chunk(q, k, v, o)
        assert backend.causal_path == "triton"
        assert_causal(o, q, k, v, backend.sm_scale)
    assert len(cudnn.calls) == 1 and backend._cudnn_causal is False


def test_not_fusable_leaves_the_chunk_to_the_extend_kernel(routed, monkeypatch):
    make, cudnn = routed
    monkeypatch.setattr(triton_backend, "fusable", lambda q: False)
    backend = make(HEADS[0])
    q, k, v = inputs(40, HEADS[0])
    assert not backend._first_chunk(q, k, v, torch.empty_like(q))
    assert backend.causal_path is None and cudnn.calls == []


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_a_later_chunk_reads_its_earlier_tokens_from_the_pool_in_two_merged_parts(heads,
                                                                                  routed):
    """After more than CHUNK_ROWS earlier tokens in one slot run, a chunk is two cuDNN calls
    (the earlier keys unmasked, exact; the chunk's own causal, its rows padded), merged by
    their log-sum-exp; where cuDNN refuses, the chunk is left to the extend kernel."""
    make, cudnn = routed
    backend = make(heads)
    first_slot, prior, tokens = 7, CHUNK_ROWS + 88, 30
    q, k, v = inputs(prior + tokens, heads, seed=2)
    k_buf, v_buf = backend.pool.k_buffers[0], backend.pool.v_buffers[0]
    k_buf[first_slot:first_slot + prior], v_buf[first_slot:first_slot + prior] = k[:prior], v[:prior]
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf, first_slot,
                                prior)
    assert backend._chunk_ok and backend.causal_path is None
    assert sorted(cudnn.calls) == [(False, CHUNK_ROWS, prior), (True, CHUNK_ROWS, CHUNK_ROWS)]
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)
    cudnn.works = False
    assert not backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf,
                                    first_slot, prior)
    assert backend._chunk_ok is False


def test_a_later_chunk_after_a_short_prior_goes_as_a_first_chunk(routed):
    make, cudnn = routed
    backend = make(HEADS[1])
    prior, tokens = 100, 60
    q, k, v = inputs(prior + tokens, HEADS[1], seed=3)
    k_buf, v_buf = backend.pool.k_buffers[0], backend.pool.v_buffers[0]
    k_buf[:prior], v_buf[:prior] = k[:prior], v[:prior]
    o = q.new_full((tokens,) + q.shape[1:], float("nan"))
    assert backend._fused_chunk(q[prior:], k[prior:], v[prior:], o, k_buf, v_buf, 0, prior)
    assert backend.causal_path == "triton" and cudnn.calls == []
    assert_causal(o, q, k, v, backend.sm_scale, skip=prior)


def test_cudnn_attention_refuses_what_cudnn_cannot_run_as_the_backend_expects():
    """On CPU tensors torch has the op but no kernel: a RuntimeError, which the backend takes
    as cuDNN's refusal. (A misnamed op would raise AttributeError and fail the prefill.)"""
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="_scaled_dot_product_cudnn_attention"):
        fused_chunks.cudnn_attention(q, q, q, causal=True, scale=0.25)
