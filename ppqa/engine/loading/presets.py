"""`dummy:<preset>` models: real architectures with seeded random weights and no files.

The big presets mirror CodeLlama-7B, Llama-3-8B, Llama-3-70B, Qwen2.5-7B and Qwen2.5-1.5B so that
speed work on the GPU machine (which has no model files) runs the true shapes; the tiny presets
feed the engine's golden tests. `loader.py` turns a preset into a `LoadedModel`: `dummy_weights`
generates each tensor directly on the target device and dtype, one at a time, so a 7B model
builds in seconds (and each tensor-parallel rank generates every tensor and keeps its slice).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ppqa.engine.model.config import ModelConfig
from ppqa.engine.loading.tokenizer import ByteTokenizer

# The benchmark's workloads hold 16k-token documents + questions + up to 1,024 answer tokens, so
# every 7B/8B preset allows 32,768 positions even where the real model's context is shorter
# (CodeLlama: 16,384; Llama 3: 8,192). Rotary embeddings extrapolate; random weights do not care.
BIG_CONTEXT = 32768

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    init_std: float  # std of the normal init of every matrix (norm weights are ones)

    def __post_init__(self) -> None:
        if not self.init_std > 0:
            raise ValueError(f"Preset init_std must be positive, got {self.init_std}")


def _preset(name: str, init_std: float = 0.02, **fields) -> Preset:
    return Preset(ModelConfig(name=f"dummy:{name}", **fields), init_std)


# Tiny presets use large weights (std 0.15) so that greedy decoding of a random model does not
# collapse to one repeated token: the golden tests need varied streams that finish at different steps.
PRESETS: dict[str, Preset] = {p.config.name.removeprefix("dummy:"): p for p in [
    _preset("codellama-7b", vocab_size=32016, hidden_size=4096, intermediate_size=11008,
            num_layers=32, num_heads=32, num_kv_heads=32, rope_theta=1e6,
            max_position_embeddings=BIG_CONTEXT),
    _preset("llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
            rope_scaling=dict(_LLAMA3_ROPE_SCALING), max_position_embeddings=BIG_CONTEXT),
    # Llama-3-70B's shapes (140 GB of bf16 weights: more than one H200 holds with room for KV),
    # for tensor parallelism; each rank generates every tensor and keeps its slice.
    _preset("llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
            num_layers=80, num_heads=64, num_kv_heads=8, rope_theta=500000.0,
            rope_scaling=dict(_LLAMA3_ROPE_SCALING), max_position_embeddings=BIG_CONTEXT),
    _preset("qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_layers=28, num_heads=28, num_kv_heads=4, rope_theta=1e6, rms_norm_eps=1e-6,
            attention_bias=True, max_position_embeddings=BIG_CONTEXT),
    _preset("qwen2.5-1.5b", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
            num_layers=28, num_heads=12, num_kv_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
            attention_bias=True, tie_word_embeddings=True, max_position_embeddings=BIG_CONTEXT),
    _preset("tiny-mha", init_std=0.15, vocab_size=384, hidden_size=64, intermediate_size=160,
            num_layers=2, num_heads=4, num_kv_heads=4, max_position_embeddings=4096),
    _preset("tiny-gqa", init_std=0.15, vocab_size=384, hidden_size=96, intermediate_size=200,
            num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16, attention_bias=True,
            rope_theta=1e6, max_position_embeddings=4096),
    _preset("tiny-odd", init_std=0.15, vocab_size=301, hidden_size=72, intermediate_size=136,
            num_layers=2, num_heads=3, num_kv_heads=1, head_dim=24, tie_word_embeddings=True,
            rms_norm_eps=1e-6, max_position_embeddings=4096),
    # head_dim 128, the size FlashInfer's kernels compile for (tests/gpu/test_flashinfer_backend.py)
    _preset("tiny-hd128", init_std=0.15, vocab_size=384, hidden_size=256, intermediate_size=320,
            num_layers=2, num_heads=2, num_kv_heads=2, head_dim=128, max_position_embeddings=4096),
]}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_config(name: str) -> tuple[ModelConfig, float, ByteTokenizer]:
    """A fresh copy of a preset's config (BOS/EOS set to the ByteTokenizer's), its init std and tokenizer.

    Raises KeyError for an unknown name (the loader turns it into ModelLoadError).
    """
    preset = PRESETS[name]
    tokenizer = ByteTokenizer(preset.config.vocab_size)
    config = replace(preset.config, bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=list(tokenizer.eos_token_ids),
                     rope_scaling=dict(preset.config.rope_scaling) if preset.config.rope_scaling else None)
    return config, preset.init_std, tokenizer


def with_tokenizer(config: ModelConfig, tokenizer, suffix: str) -> ModelConfig:
    """A preset's config fitted to another tokenizer: its vocabulary (embedding and lm_head
    shapes), BOS and EOS ids; `suffix` marks the name (e.g. "+bpe")."""
    return replace(config, name=config.name + suffix, vocab_size=tokenizer.vocab_size,
                   bos_token_id=tokenizer.bos_token_id, eos_token_ids=list(tokenizer.eos_token_ids))


def weight_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama weight names and shapes of a config, in a fixed order."""
    h, q_out, kv_out = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q_out, h)
        yield p + "self_attn.k_proj.weight", (kv_out, h)
        yield p + "self_attn.v_proj.weight", (kv_out, h)
        if config.attention_bias:
            yield p + "self_attn.q_proj.bias", (q_out,)
            yield p + "self_attn.k_proj.bias", (kv_out,)
            yield p + "self_attn.v_proj.bias", (kv_out,)
        yield p + "self_attn.o_proj.weight", (h, q_out)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (config.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (config.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, config.intermediate_size)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


def dummy_weights(config: ModelConfig, init_std: float, *, device: torch.device, dtype: torch.dtype,
                  seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights, generated on `device` in `dtype`, one tensor at a time.

    Norm weights are ones; every matrix and bias is normal(0, init_std). The values depend on the
    seed and the device type (CPU and CUDA generators differ), never on the iteration order of a
    caller, because the stream is regenerated from the seed on every call.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, shape in weight_shapes(config):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, device=device, dtype=dtype)
        else:
            tensor = torch.empty(shape, device=device, dtype=dtype)
            tensor.normal_(0.0, init_std, generator=generator)
        yield name, tensor
