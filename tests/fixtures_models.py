"""Shared model fixtures: one downloaded SmolLM2 per machine, and a transformers twin of any model.

`smollm2_gguf` (session) pulls the embedded model once into a cache shared across tests and runs
(`$PPQA_TEST_MODELS`, default `~/.cache/ppqa-test-models`); `smollm2` (per test) links that file
into the test's own `$PPQA_HOME` (tests/conftest.py points it at a temp dir), so `Engine("smollm2")`
and `load_model("smollm2")` find it without another download. `hf_twin` builds a transformers model
from our `ModelConfig` and loads our weights into it: the reference the loader tests compare with.

Registered for the whole suite by `pytest_plugins = ["tests.fixtures_models"]` in tests/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ppqa.engine.loading import model_cache
from ppqa.engine.model.config import ModelConfig


def shared_models_dir() -> Path:
    return Path(os.environ.get("PPQA_TEST_MODELS") or Path.home() / ".cache" / "ppqa-test-models")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF in the shared test cache (downloaded on the first run on a machine)."""
    return model_cache.ensure("smollm2", root=shared_models_dir())


@pytest.fixture
def smollm2(smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The SmolLM2 GGUF linked into this test's $PPQA_HOME; returns the linked path."""
    if not os.environ.get("PPQA_HOME"):  # never touch the user's real data dir
        monkeypatch.setenv("PPQA_HOME", str(tmp_path / "ppqa-home"))
    target = model_cache.embedded_path("smollm2")
    if not model_cache.is_cached("smollm2"):
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(smollm2_gguf)
    return target


def hf_config(config: ModelConfig):
    """A transformers config equivalent to ours (Qwen2 for q/k/v bias, Llama otherwise)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**config.rope_scaling, "rope_theta": config.rope_theta}
        rope["rope_type"] = rope.pop("type", None) or rope["rope_type"]
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                  head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
                  max_position_embeddings=config.max_position_embeddings,
                  tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope)
    if config.attention_bias:
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(attention_bias=False, **common)


def hf_twin(config: ModelConfig, weights) -> torch.nn.Module:
    """A transformers causal LM built from `config`, holding exactly `weights` (fp32, eval mode)."""
    import transformers

    hc = hf_config(config)
    cls = transformers.Qwen2ForCausalLM if config.attention_bias else transformers.LlamaForCausalLM
    model = cls(hc).eval()
    state = {name: w.float() for name, w in weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied model's lm_head is the embedding: transformers lists it as missing but shares it.
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model
