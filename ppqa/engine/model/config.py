"""Model configuration: the one description of a Llama-family architecture.

Loaders (`engine/loading/`) produce a `ModelConfig` from a Hugging Face `config.json`, GGUF
metadata or a `dummy:` preset; the model (`engine/model/llama.py`) and the KV pool read it.
Weight names follow Hugging Face's Llama naming (`model.layers.N.self_attn.q_proj.weight`, ...),
whatever the source, so every loader hands the model the same state dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_heads
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict (Llama-3 "llama3" type supported), or None.
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2/2.5)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def projection_params_per_layer(self) -> int:
        """Weights of one layer's matrices: q, k, v, o and the gated MLP's three."""
        h, q_width = self.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return h * (q_width + 2 * kv_width) + q_width * h + 3 * h * self.intermediate_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
