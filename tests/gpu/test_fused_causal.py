"""A document's first prefill chunk in bf16 goes through torch's fused causal attention
(`TritonBackend._fused_causal`); it must give what the extend kernel gives for the same chunk
(the stream rule with every token a document token is plain causal attention)."""

import dataclasses

import pytest
import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig
from ppqa.engine.runtime.request import Stream

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-hd128"])
def test_first_chunk_fused_causal_matches_the_extend_kernel(model):
    eng = Engine(f"dummy:{model}", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05, max_prefill_tokens=700))
    cfg = eng.model_config
    gen = torch.Generator().manual_seed(0)
    doc_ids = torch.randint(3, cfg.vocab_size, (1000,), generator=gen).tolist()
    stream = Stream(key=0, suffix_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=1),
                    seed=0, prompt_tokens=1003)
    session = eng.session()
    for req in session._requests(doc_ids, [stream], "cascade", 1):
        session.sched.add(req)
    session.sched.admit()
    doc = session.sched.pending_documents()[0]
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
    assert backend._causal_backends, "no fused causal backend took the chunk"
    kernel = backend.forward(0, q, k, v, dataclasses.replace(meta, plain_causal=False))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(h // hk, 0),
        v.float().transpose(0, 1).repeat_interleave(h // hk, 0), is_causal=True,
        scale=d ** -0.5).transpose(0, 1)
    for got in (fused, kernel):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 1e-2, err
    session.close()
