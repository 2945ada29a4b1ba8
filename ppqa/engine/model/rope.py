"""Rotary position embeddings (Hugging Face's "rotate half" layout), with Llama-3 and linear scaling.

`RotaryEmbedding` holds a cos/sin table for every position up to the model's context, built once
on the model's device; the attention layers rotate q and k by the positions the runner gives each
new token (for `parallel`, every stream's positions start at the document length).
"""

from __future__ import annotations

import math

import torch

from ppqa.engine.model.config import ModelConfig


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] (float32, CPU), after the config's rope scaling."""
    # float32 throughout, as Hugging Face computes it, so positions rotate identically.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept; the band between is blended.
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        blend = (old_context / wavelen - low) / (high - low)
        blended = (1 - blend) * scaled / factor + blend * scaled
        in_band = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_positions, head_dim] in float32; `forward` rotates q and k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.max_positions = config.max_position_embeddings
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        """Fill the tables on `device` (called once the model leaves the meta device)."""
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] rotated by positions [T]; computed in float32."""
        if self.cos is None:
            raise RuntimeError("RotaryEmbedding.build(device) was not called")
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        qf, kf = q.float(), k.float()
        q_out = qf * cos + rotate_half(qf) * sin
        k_out = kf * cos + rotate_half(kf) * sin
        return q_out.to(q.dtype), k_out.to(k.dtype)
