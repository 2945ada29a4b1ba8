"""TritonBackend under CUDA graph capture: a captured step replayed on new inputs gives what an
eager step gives (extend for a `parallel` decode step, stock decode, cascade decode)."""

import math
from types import SimpleNamespace

import pytest
import torch

from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata
from ppqa.engine.attention.triton_backend import TritonBackend
from tests.kernels.kernel_inputs import Pool, decode_step, parallel_step

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
HEADS = [(32, 32, 128), (28, 4, 128)]


def _meta(batch, kind, cascade=None) -> ForwardMetadata:
    tokens = batch.q.shape[0]
    ends = batch.prefix_lens.long() + batch.qo_indptr.diff().long()
    new_slots = [batch.req_to_token[b, int(p):int(e)]
                 for b, (p, e) in enumerate(zip(batch.prefix_lens.tolist(), ends.tolist()))]
    return ForwardMetadata(
        kind=kind, positions=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        out_slots=torch.cat(new_slots).long(), q_sid=batch.q_sid, qo_indptr=batch.qo_indptr,
        req_indices=batch.req_indices, kv_start=batch.kv_start, prefix_lens=batch.prefix_lens,
        req_to_token=batch.req_to_token,
        logit_indices=torch.arange(tokens, device="cuda"), max_extend_len=batch.max_extend_len,
        max_prefix_len=int(batch.prefix_lens.max()), cascade=cascade)


def _steps(heads, gen):
    num_heads, num_kv_heads, head_dim = heads
    pool = Pool(40000, num_kv_heads, head_dim, torch.bfloat16, "cuda", gen)
    par = parallel_step(pool, 8000, [[5] * 32, [7] * 32], 3, num_heads, head_dim, gen, "cuda")
    yield pool, par, _meta(par, "extend")
    dec, indptr, doc_rows = decode_step(pool, (6000,), [[30] * 48], num_heads, head_dim, gen,
                                        "cuda")
    yield pool, dec, _meta(dec, "decode")
    cas, indptr, doc_rows = decode_step(pool, (6000, 2000), [[30] * 40, [9] * 24], num_heads,
                                        head_dim, gen, "cuda", cascade=True)
    to = dict(device="cuda", dtype=torch.int32)
    casc = CascadeMetadata(torch.tensor(indptr, **to), torch.tensor(doc_rows, **to),
                           torch.tensor([6000, 2000], **to), max_group_size=40, max_doc_len=6000)
    yield pool, cas, _meta(cas, "decode", casc)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_captured_step_replays_like_eager(heads):
    gen = torch.Generator().manual_seed(17)
    for pool, batch, meta in _steps(heads, gen):
        pool_view = SimpleNamespace(k_buffers=[pool.k], v_buffers=[pool.v],
                                    slot_sid=pool.slot_sid.cuda())
        backend = TritonBackend(pool_view, heads[0], heads[1], heads[2], 1 / math.sqrt(heads[2]))
        q, k, v = batch.q.clone(), batch.k_new.clone(), batch.v_new.clone()
        backend.forward(0, q, k, v, meta)  # compile and plan outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(0, q, k, v, meta)
        for _ in range(2):  # new inputs each replay, as a decode loop would give
            q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
            k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
            graph.replay()
            eager = backend.forward(0, q, k, v, meta)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"{meta.kind} cascade={meta.cascade is not None}"
