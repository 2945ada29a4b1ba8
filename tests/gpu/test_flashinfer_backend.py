"""FlashInfer's decode kernel as a second stock baseline (ppqa/engine/flashinfer_backend.py):
on every decode step of a stock run, its attention output matches our decode kernel's on the
same pool and rows. Needs CUDA and the flashinfer package (benchmarks/flashinfer_device.sh
builds its source release on the GPU machine); skipped without either."""

import importlib.util

import pytest
import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                 reason="needs the flashinfer package")]


@pytest.mark.parametrize("model,tensor_cores", [("tiny-hd128", False), ("qwen2.5-1.5b", True)])
def test_flashinfer_decode_matches_ours_on_every_step(model, tensor_cores, monkeypatch):
    from ppqa.engine.attention.flashinfer_backend import FlashInferBackend
    from ppqa.engine.attention.triton_backend import TritonBackend

    eng = Engine(f"dummy:{model}", device="cuda",
                 config=EngineConfig(attention_backend="flashinfer", mem_fraction=0.2))
    backend = eng.parts.backend
    assert isinstance(backend, FlashInferBackend) and backend.tensor_cores == tensor_cores
    assert eng.parts.runner.graphs is None
    errors = []
    flashinfer_forward = FlashInferBackend.forward

    def both(self, layer, q, k, v, meta):
        out = flashinfer_forward(self, layer, q, k, v, meta)
        if self._flashinfer_step(meta):  # ours on the same step (its K/V store is idempotent)
            ours = TritonBackend.forward(self, layer, q, k, v, meta).float()
            errors.append(float((out.float() - ours).norm() / ours.norm()))
        return out

    monkeypatch.setattr(FlashInferBackend, "forward", both)
    questions = [f"What is said about item {i}?" * (1 + i % 3) for i in range(9)]
    answers = eng.answer("A document about items and what they do. " * 20, questions,
                         mode="stock", sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(a.token_ids) == 6 for a in answers)
    layers = eng.model_config.num_layers
    assert len(errors) == 5 * layers  # the first token comes from the prefill
    assert max(errors) < 2e-2, max(errors)
