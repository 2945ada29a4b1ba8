"""Our Llama model (fused q/k/v and gate/up, rope, GQA, bias, tied embeddings, rope scaling) against
transformers' own LlamaForCausalLM / Qwen2ForCausalLM holding the same random weights.

The sequence runs through the real runner and torch attention backend as one or several extends
(chunked prefill), so the KV pool path is part of what is compared.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.layout import document_layout
from ppqa.engine.model.llama import build_model
from ppqa.engine.loading.presets import dummy_weights, preset_config
from ppqa.engine.runtime.runner import ModelRunner, StepInputs
from ppqa.engine.attention.torch_backend import TorchBackend
from tests.helpers import hf_twin

CPU = torch.device("cpu")


def preset(name: str, **changes):
    config, std, _ = preset_config(name)
    config = dataclasses.replace(config, **changes)

    def weights():
        return dummy_weights(config, std, device=CPU, dtype=torch.float32, seed=3)
    return config, weights


def our_logits(config, weights, ids: list[int], chunks: int) -> torch.Tensor:
    model = build_model(config, weights(), device=CPU, dtype=torch.float32)
    pool = KVPool(len(ids) + 1, config.num_layers, config.num_kv_heads, config.head_dim,
                  dtype=torch.float32, device=CPU)
    table = ReqToTokenTable(1, len(ids), CPU)
    table.write(1, 0, pool.allocator.alloc(len(ids)))
    backend = TorchBackend(pool, config.num_heads, config.num_kv_heads, config.head_dim,
                           config.head_dim ** -0.5)
    runner = ModelRunner(model, pool, table, backend, CPU)
    bounds = [round(i * len(ids) / chunks) for i in range(chunks + 1)]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        step = StepInputs(kind="extend", input_ids=torch.tensor(ids[start:end]),
                          layout=document_layout(start, end), qo_indptr=torch.tensor([0, end - start]),
                          req_rows=torch.tensor([1]), kv_start=torch.tensor([0]),
                          prefix_lens=torch.tensor([start]), logit_indices=torch.arange(end - start))
        out.append(runner.run(step))
    return torch.cat(out)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


@pytest.mark.parametrize("name,changes,chunks", [
    ("tiny-mha", {}, 1),
    ("tiny-gqa", {}, 3),  # GQA + q/k/v bias (Qwen2) + chunked prefill
    ("tiny-odd", {}, 2),  # one KV head, head_dim 24, tied embeddings
    ("tiny-mha", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}, 1),
    ("tiny-gqa", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 1),
])
def test_model_matches_transformers(name: str, changes: dict, chunks: int) -> None:
    config, weights = preset(name, **changes)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, config.vocab_size, (300,), generator=gen).tolist()
    ours = our_logits(config, weights, ids, chunks)
    with torch.no_grad():
        theirs = hf_twin(config, weights())(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_load_rejects_wrong_shape_missing_and_unknown_weights() -> None:
    config, weights = preset("tiny-mha")

    def reshaped():
        for n, w in weights():
            yield n, (w[:-1] if n == "model.layers.1.mlp.up_proj.weight" else w)

    with pytest.raises(ValueError, match=r"up_proj.weight.*shape \(159, 64\).*\(160, 64\)"):
        build_model(config, reshaped(), device=CPU, dtype=torch.float32)
    missing = ((n, w) for n, w in weights() if n != "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="do not fill 1 parameter.*qkv_proj"):
        build_model(config, missing, device=CPU, dtype=torch.float32)
    extra = [*weights(), ("model.layers.7.mlp.up_proj.weight", torch.zeros(1))]
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.7"):
        build_model(config, extra, device=CPU, dtype=torch.float32)


def test_unsupported_rope_scaling_is_named() -> None:
    config, weights = preset("tiny-mha", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        build_model(config, weights(), device=CPU, dtype=torch.float32)
