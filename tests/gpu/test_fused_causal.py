"""A document's first prefill chunk in bf16 goes through our causal kernel or cuDNN
(`TritonBackend._first_chunk`); it must give what the extend kernel gives for the same chunk
(the stream rule with every token a document token is plain causal attention)."""

import dataclasses

import pytest
import torch

from ppqa import Engine
from ppqa.config import EngineConfig
from tests.helpers import pending_document

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-hd128"])
def test_first_chunk_fused_causal_matches_the_extend_kernel(model):
    eng = Engine(f"dummy:{model}", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05, max_prefill_tokens=700))
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(0)
    doc_ids = torch.randint(3, cfg.vocab_size, (1000,), generator=gen).tolist()
    session, doc = pending_document(eng, doc_ids)
    first = session.sched.document_chunk(doc)
    assert first.plain_causal and first.num_tokens == 700
    second = session.sched.document_chunk(doc)
    assert not second.plain_causal  # it reads the first chunk from the pool
    _, meta = eng.parts.runner.prepare(first)
    backend = eng.parts.backend
    t, h, hk, d = first.num_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    fused = backend.forward(0, q, k, v, meta)
    assert backend.causal_path in ("triton", "cudnn"), "the extend kernel took the chunk"
    kernel = backend.forward(0, q, k, v, dataclasses.replace(meta, plain_causal=False))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(h // hk, 0),
        v.float().transpose(0, 1).repeat_interleave(h // hk, 0), is_causal=True,
        scale=d ** -0.5).transpose(0, 1)
    for got in (fused, kernel):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2, err
    session.close()


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-hd128"])
@pytest.mark.parametrize("plan_seconds", [1e-12, None])
def test_a_first_chunk_row_class_runs_ours_until_it_has_cost_cudnns_plan(model, plan_seconds,
                                                                        monkeypatch):
    """A first chunk's row class (rows padded to CHUNK_ROWS) runs through our kernel (cuDNN
    would build a plan for it) until the time that cost over cuDNN adds up to a plan: with a
    plan that costs next to nothing, cuDNN takes the second call; with the real plan's cost,
    a short chunk of a tiny model stays on ours. A chunk of another length in the same class
    after a copied opening of 59 tokens follows the class's choice. All are causal
    attention."""
    from ppqa.engine.attention import fused_chunks

    monkeypatch.setattr(fused_chunks, "_CAUSAL_TRITON_LOSS", {})
    if plan_seconds is not None:
        monkeypatch.setattr(fused_chunks, "CUDNN_PLAN_SECONDS", plan_seconds)
    tokens = 1000  # class 1,024: cuDNN's padding costs less than its rate gains
    eng = Engine(f"dummy:{model}", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05, max_prefill_tokens=tokens))
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(1)
    session, doc = pending_document(
        eng, torch.randint(3, cfg.vocab_size, (tokens + 50,), generator=gen).tolist())
    first = session.sched.document_chunk(doc)
    assert first.plain_causal and first.num_tokens == tokens
    _, meta = eng.parts.runner.prepare(first)
    backend = eng.parts.backend
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    used = []
    for _ in range(2):
        q = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(tokens, hk, d, device="cuda", dtype=torch.bfloat16)
        got = backend.forward(0, q, k, v, meta)
        used.append(backend.causal_path)
        ref = _causal_reference(q, k, v)
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2, err
    second = "triton" if plan_seconds is None else "cudnn"
    assert used == ["triton", second]
    prior, rows = 59, 959
    q = torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, hk, d, device="cuda", dtype=torch.bfloat16)
    got = torch.full((rows - prior, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert backend._first_chunk(q[prior:], k[prior:], v[prior:], got, k[:prior], v[:prior])
    assert backend.causal_path == second
    ref = _causal_reference(q, k, v)[prior:]
    err = (got.float() - ref).norm() / ref.norm()
    assert torch.isfinite(got).all() and err < 1e-2, err
    session.close()


def _causal_reference(q, k, v):
    """fp32 causal attention: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(h // hk, 0),
        v.float().transpose(0, 1).repeat_interleave(h // hk, 0), is_causal=True,
        scale=d ** -0.5).transpose(0, 1)


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-hd128"])
def test_a_later_chunk_through_cudnn_matches_the_extend_kernel(model):
    eng = Engine(f"dummy:{model}", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05, max_prefill_tokens=700))
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(1)
    doc_ids = torch.randint(3, cfg.vocab_size, (1000,), generator=gen).tolist()
    session, doc = pending_document(eng, doc_ids)
    first, second = (session.sched.document_chunk(doc) for _ in range(2))
    assert second.doc_prior == (doc.start, 700) and second.num_tokens == 300
    backend = eng.parts.backend
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(1000, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1000, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1000, hk, d, device="cuda", dtype=torch.bfloat16)
    _, meta1 = eng.parts.runner.prepare(first)
    backend.forward(0, q[:700], k[:700], v[:700], meta1)  # the first chunk's K/V into the pool
    _, meta2 = eng.parts.runner.prepare(second)
    fused = backend.forward(0, q[700:], k[700:], v[700:], meta2)
    if model == "tiny-hd128":
        assert backend._chunk_ok, "cuDNN did not take the chunk"
    kernel = backend.forward(0, q[700:], k[700:], v[700:],
                             dataclasses.replace(meta2, doc_prior=None))
    ref = _causal_reference(q, k, v)[700:]
    for got in (fused, kernel):
        assert got.shape == ref.shape and torch.isfinite(got).all()
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2, err
    session.close()


def test_cudnn_attention_with_its_lse_merges_to_causal_attention_under_gqa():
    # Qwen2.5-7B's heads: 28 query heads sharing 4 KV heads of 128.
    from ppqa.engine.attention.fused_chunks import cudnn_attention, heads_first
    from ppqa.kernels.merge import merge_attention_states

    torch.manual_seed(0)
    t, prior, h, hk, d = 256, 640, 28, 4, 128
    q = torch.randn(prior + t, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(prior + t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(prior + t, hk, d, device="cuda", dtype=torch.bfloat16)
    qh = q[prior:].unsqueeze(0).transpose(1, 2)
    scale = d ** -0.5
    o_a, lse_a = cudnn_attention(qh, heads_first(k[:prior], h // hk), heads_first(v[:prior], h // hk),
                                 causal=False, scale=scale)
    o_b, lse_b = cudnn_attention(qh, heads_first(k[prior:], h // hk), heads_first(v[prior:], h // hk),
                                 causal=True, scale=scale)
    assert lse_a.shape == (t, h) and lse_a.dtype == torch.float32
    # lse is the natural log of the sum of exp(scaled scores) over the keys seen.
    scores = torch.einsum("thd,shd->ths", q[prior:].float(),
                          k[:prior].float().repeat_interleave(h // hk, 1)) * scale
    assert torch.allclose(lse_a, torch.logsumexp(scores, dim=-1), atol=2e-2)
    out = torch.empty(t, h, d, device="cuda", dtype=torch.bfloat16)
    merge_attention_states(o_a, lse_a, o_b, lse_b, out)
    ref = _causal_reference(q, k, v)[prior:]
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err


@pytest.mark.parametrize("prior", [54, 700])
def test_chunk_attention_through_cudnn_after_a_short_and_a_long_prior(prior):
    """A chunk after a short prior (a template's opening copied from a cached document) runs as
    one causal call over both; after a long one, as two parts merged: both give causal attention."""
    from ppqa.engine.attention.fused_chunks import chunk_attention

    torch.manual_seed(prior)
    t, h, hk, d = 1000, 28, 4, 128
    q = torch.randn(prior + t, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(prior + t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(prior + t, hk, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full((t, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    chunk_attention(q[prior:], k[prior:], v[prior:], k[:prior], v[:prior], out, d ** -0.5)
    ref = _causal_reference(q, k, v)[prior:]
    assert torch.isfinite(out).all()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err
