"""The warm-up's cuDNN calls (`TritonBackend.warm_cudnn_kernels`): a document chunk's calls in
each kind a prefill meets, so that cuDNN's once-per-machine kernel builds happen in a warm-up
(or its compile helper), not in a job's prefill with the GPU idle."""

from __future__ import annotations

import pytest
import torch
from checks import DEVICE, HEADS, ON_GPU

from ppqa.engine.attention import fused_chunks, triton_backend
from ppqa.engine.attention.triton_backend import TritonBackend
from ppqa.engine.runtime.kv_cache import KVPool

DTYPE = torch.bfloat16 if ON_GPU else torch.float32


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_the_warmup_calls_cudnn_in_each_kind_a_prefill_meets(heads, monkeypatch):
    num_heads, kv_heads, dim = heads
    pool = KVPool(64, 1, kv_heads, dim, dtype=DTYPE, device=DEVICE)
    backend = TritonBackend(pool, num_heads, kv_heads, dim, dim ** -0.5, scratch_bytes=1 << 20)
    met = []
    real = fused_chunks.cudnn_attention

    def recorded(q, k, v, *, causal, scale):
        met.append((causal, q.shape[1], q.shape[2], k.shape[2]))
        return real(q, k, v, causal=causal, scale=scale)

    monkeypatch.setattr(fused_chunks, "cudnn_attention", recorded)
    calls = backend.warm_cudnn_kernels()
    if not ON_GPU:  # fp32 on the CPU: cuDNN takes no such tensors, nothing to build
        assert calls == 0 and met == []
        return
    assert calls == len(met) == 4
    # every query head (KV heads repeated for a grouped model), a chunk of 2048 rows; the
    # unmasked part over an earlier run of 2048 keys and of 2107 (no multiple of 64)
    assert sorted(met) == [(False, num_heads, 2048, 2048), (False, num_heads, 2048, 2107),
                           (True, num_heads, 2048, 2048), (True, num_heads, 2048, 2048)]


def test_a_warmup_goes_on_where_cudnn_refuses_the_shapes(monkeypatch):
    """A model whose heads cuDNN does not take (the engine's own chunks then fall back to other
    kernels): the warm-up's cuDNN calls give up quietly, and the warm-up goes on."""
    num_heads, kv_heads, dim = HEADS[0]
    pool = KVPool(64, 1, kv_heads, dim, dtype=DTYPE, device=DEVICE)
    backend = TritonBackend(pool, num_heads, kv_heads, dim, dim ** -0.5, scratch_bytes=1 << 20)

    def refuse(q, k, v, *, causal, scale):
        raise RuntimeError("cuDNN: no engine for these shapes")

    monkeypatch.setattr(triton_backend, "fusable", lambda q: True)
    monkeypatch.setattr(fused_chunks, "cudnn_attention", refuse)
    assert backend.warm_cudnn_kernels() == 0
