"""The Llama-family decoder (Llama 2/3, CodeLlama, Mistral, Qwen2/2.5, SmolLM2).

Built on the meta device by `build_model`, materialized once on the target device and filled from
the loader's stream of Hugging Face-named tensors (`load_weights`): q/k/v are fused into one
`qkv_proj` matrix and gate/up into one `gate_up_proj` at load time, one copy per tensor, no second
model in memory. The model knows nothing about modes or attention kernels: every attention layer
hands its q/k/v and the step's `ForwardMetadata` to the attention backend, which owns the KV pool.

With `fused_kernels` (the default on a CUDA device) RMSNorm with its residual add, SiLU * up and
the rotary embedding run as one Triton kernel each (`ppqa.kernels.fused`) instead of a handful of
torch kernels; elsewhere the torch code below runs, and CPU tests compare it with transformers.
The layers pass the residual stream along beside their output (`hidden, residual`), so the add
that closes one sublayer is fused into the norm that opens the next.

Data flow of a step: runner -> `forward(input_ids, positions, meta, backend)` -> hidden states
[T, hidden] -> runner picks the rows it needs -> `compute_logits` -> sampler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from ppqa.engine.attention.metadata import AttentionBackend, ForwardMetadata
from ppqa.engine.model.config import ModelConfig
from ppqa.engine.model.rope import RotaryEmbedding

try:
    from ppqa.kernels import fused
except ModuleNotFoundError as e:  # triton is installed on Linux x86-64 only; torch needs none
    if e.name != "triton":
        raise
    fused = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, fused_kernels: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); given a residual: (norm(x + residual), x + residual)."""
        if self.fused_kernels:
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32, as Hugging Face does, so bf16 runs match the reference closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype,
                 fused_kernels: bool) -> None:
        super().__init__()
        self.layer = layer
        self.fused_kernels = fused_kernels
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: ForwardMetadata, backend: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.fused_kernels:
            q, k = fused.apply_rope(q, k, positions, rope.cos, rope.sin)
        else:
            q, k = rope(positions, q, k)
        out = backend.forward(self.layer, q, k, v, meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, fused_kernels: bool) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.fused_kernels = fused_kernels
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False,
                                      dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False,
                                   dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_kernels:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype,
                 fused_kernels: bool) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype, fused_kernels)
        self.self_attn = LlamaAttention(config, layer, dtype, fused_kernels)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype, fused_kernels)
        self.mlp = LlamaMLP(config, dtype, fused_kernels)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, meta: ForwardMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream entering the layer is hidden + residual (the first layer gets residual None:
        all of it is in hidden); returns the pair whose sum is the stream leaving it."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, rope, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 fused_kernels: bool = False) -> None:
        super().__init__()
        if fused_kernels and fused is None:
            raise ValueError("fused_kernels needs triton, which is not installed")
        self.config = config
        # An explicit (empty) weight: the loader fills it, and nn.Embedding's random init on the
        # meta device would import torch._dynamo (seconds in every worker and helper process).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, fused_kernels)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fused_kernels)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype))
        self.rope = RotaryEmbedding(config)
        # Set by a transform whose lm_head holds part of the vocabulary (tensor parallelism):
        # this rank's logits in, every rank's together out.
        self.gather_logits = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rope, meta, backend)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> float32 logits [R, vocab]."""
        x = self.norm(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = (x @ weight.t()).float()
        return logits if self.gather_logits is None else self.gather_logits(logits)


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], *,
                device: torch.device, dtype: torch.dtype,
                fused_kernels: bool | None = None, transform=None) -> LlamaModel:
    """A model on `device` in `dtype`, filled from the loader's (name, tensor) stream.
    `fused_kernels` None: the Triton kernels on a CUDA device, torch code elsewhere (tests force
    the kernels on the CPU, where they run under Triton's interpreter). `transform(model,
    weights) -> weights` changes the model while it is still on the meta device and returns
    the stream that fills the changed model (tensor parallelism: a rank's shard)."""
    if fused_kernels is None:
        fused_kernels = torch.device(device).type == "cuda"
    with torch.device("meta"):
        model = LlamaModel(config, dtype, fused_kernels)
    if transform is not None:
        weights = transform(model, weights)
    _materialize(model, torch.device(device))
    load_weights(model, weights)
    model.rope.build(device)
    model.eval().requires_grad_(False)
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Module.to_empty by shape: uninitialised storage on `device` for every meta parameter and
    buffer. (to_empty's empty_like on meta tensors goes through torch's Python references, which
    import sympy: seconds in every process that builds a model.)"""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buf in module.named_buffers(recurse=False):
            module.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype, device=device),
                                   persistent=name not in module._non_persistent_buffers_set)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _destination(model: LlamaModel, name: str) -> tuple[torch.Tensor, int, int] | None:
    """(parameter, first row, row count) a Hugging Face tensor fills, or None for tensors we ignore."""
    cfg = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, 0, cfg.vocab_size
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size
    if name == "lm_head.weight":
        if model.lm_head is None:  # tied models may still ship a copy; the embedding is the truth
            return None
        return model.lm_head.weight, 0, cfg.vocab_size
    match = _LAYER_NAME.fullmatch(name)
    if match is None or int(match.group(1)) >= cfg.num_layers:
        raise ValueError(f"unexpected weight {name!r} for a {cfg.num_layers}-layer Llama model")
    layer = model.layers[int(match.group(1))]
    rest = match.group(2)
    if rest.endswith("rotary_emb.inv_freq"):  # older checkpoints store the rope table; we compute it
        return None
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
    table = {
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, cfg.hidden_size),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0, cfg.hidden_size),
        "self_attn.o_proj.weight": (attn.o_proj.weight, 0, cfg.hidden_size),
        "mlp.down_proj.weight": (mlp.down_proj.weight, 0, cfg.hidden_size),
        "mlp.gate_proj.weight": (mlp.gate_up_proj.weight, 0, inter),
        "mlp.up_proj.weight": (mlp.gate_up_proj.weight, inter, inter),
    }
    for proj, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
        table[f"self_attn.{proj}_proj.weight"] = (attn.qkv_proj.weight, start, rows)
        if cfg.attention_bias:
            table[f"self_attn.{proj}_proj.bias"] = (attn.qkv_proj.bias, start, rows)
    if rest not in table:
        raise ValueError(f"unexpected weight {name!r} (attention_bias={cfg.attention_bias})")
    return table[rest]


def load_weights(model: LlamaModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each named tensor into its (possibly fused) parameter; every parameter must be filled."""
    filled: dict[int, int] = {}  # id(parameter) -> elements written
    with torch.no_grad():
        for name, tensor in weights:
            dest = _destination(model, name)
            if dest is None:
                continue
            param, start, rows = dest
            target = param[start:start + rows]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model "
                                 f"({model.config.name}) expects {tuple(target.shape)}")
            target.copy_(tensor)
            filled[id(param)] = filled.get(id(param), 0) + target.numel()
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.numel()]
    if missing:
        raise ValueError(f"the weights do not fill {len(missing)} parameter(s) of the model, e.g. "
                         f"{', '.join(missing[:4])} (weights filled are matched by Hugging Face "
                         f"Llama names)")
