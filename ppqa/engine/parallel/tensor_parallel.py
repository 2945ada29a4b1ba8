"""Tensor parallelism as a transform of a built model (Megatron's split, gpt-fast's way).

`TensorParallel` names this process's place: rank r of N, the process group for the model's
collectives (NCCL on GPUs, gloo on the CPU) and a gloo group for host objects (the lockstep's
commands, `lockstep.py`). `check_divisible(config, N)` refuses a model whose attention heads,
KV heads or MLP width do not split evenly, before any weight loads.

`shard_model(model, tp)` runs on the model while it is still on the meta device:
  - fused q/k/v and gate/up become column-parallel: rank r keeps heads [r*H/N, (r+1)*H/N) of q,
    its KV heads of k and v, and its slice of the MLP width, so attention runs per head on a
    rank's own heads and the KV pool of a rank holds only its KV heads;
  - o_proj and down_proj become row-parallel (the matching input columns); a forward hook
    all-reduces each one's output: one all-reduce after attention, one after the MLP;
  - an untied lm_head becomes vocabulary-parallel (rows [r*C, r*C + C), C = ceil(V/N)) and
    `model.gather_logits` all-gathers the rank's logits into the full [R, V] on every rank, so
    sampling runs unchanged. A tied head uses the replicated embedding: full logits, no gather.
  - the embedding and the norms are replicated.
`shard_weights(model, weights, tp)` then slices each full Hugging Face tensor of the loader's
stream to this rank's part, one tensor at a time, so every source (dummy, safetensors, GGUF)
loads sharded and no rank ever holds the whole model; dummy weights are generated whole and
sliced, so a TP=N model holds exactly the TP=1 model's values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ppqa.engine.model.config import ModelConfig

_LAYER_NAME = re.compile(r"model\.layers\.\d+\.(.+)")


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world` ranks; `group` carries the model's tensors, `control` host objects."""

    rank: int
    world: int
    group: object = None  # torch.distributed ProcessGroup (None: the default group)
    control: object = None  # a gloo group for pickled objects (None: the default group)

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"TensorParallel.world must be an integer >= 1, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"TensorParallel.rank must be in [0, {self.world}), got {self.rank!r}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_process_group(cls, world: int, device: torch.device) -> TensorParallel:
        """This process's place in the initialized default group, which must hold `world`
        ranks; on CUDA a gloo group is added for the lockstep's host objects."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"tensor_parallel {world} needs torch.distributed initialized with "
                             f"{world} processes (one per rank; `ppqa run --tensor-parallel` "
                             "starts them), but no process group exists")
        if dist.get_world_size() != world:
            raise ValueError(f"tensor_parallel {world} needs a process group of {world} ranks, "
                             f"this one has {dist.get_world_size()}")
        control = dist.new_group(backend="gloo") if device.type == "cuda" else None
        return cls(rank=dist.get_rank(), world=world, control=control)


def check_divisible(config: ModelConfig, world: int) -> None:
    """ValueError unless heads, KV heads and the MLP width split evenly over `world` ranks."""
    if world == 1:
        return
    parts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
             "MLP width (intermediate_size)": config.intermediate_size}
    bad = [f"{n} {what}" for what, n in parts.items() if n % world]
    if bad:
        raise ValueError(f"model {config.name} cannot be split over tensor_parallel {world}: "
                         f"it has {', '.join(bad)}, which {world} does not divide; use a "
                         f"tensor_parallel that divides {config.num_heads} heads and "
                         f"{config.num_kv_heads} KV heads")


def vocab_chunk(vocab_size: int, world: int) -> int:
    """Rows of the vocabulary-parallel head per rank (the last rank may hold fewer)."""
    return -(-vocab_size // world)


def _meta_linear(rows: int, cols: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(cols, rows, bias=bias, dtype=dtype)


def shard_model(model, tp: TensorParallel) -> None:
    """Shrink a meta-device model to rank `tp.rank`'s shard and hook in the collectives."""
    cfg, n = model.config, tp.world
    if n == 1:
        return
    check_divisible(cfg, n)
    if next(model.parameters()).device.type != "meta":
        raise ValueError("shard_model runs on a model still on the meta device, before loading")
    dtype = model.embed_tokens.weight.dtype
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = cfg.num_heads // n, cfg.num_kv_heads // n
        attn.q_size = attn.num_heads * attn.head_dim
        attn.kv_size = attn.num_kv_heads * attn.head_dim
        attn.qkv_proj = _meta_linear(attn.q_size + 2 * attn.kv_size, cfg.hidden_size,
                                     cfg.attention_bias, dtype)
        attn.o_proj = _meta_linear(cfg.hidden_size, attn.q_size, False, dtype)
        mlp.intermediate = cfg.intermediate_size // n
        mlp.gate_up_proj = _meta_linear(2 * mlp.intermediate, cfg.hidden_size, False, dtype)
        mlp.down_proj = _meta_linear(cfg.hidden_size, mlp.intermediate, False, dtype)
        for row_parallel in (attn.o_proj, mlp.down_proj):
            row_parallel.register_forward_hook(_all_reduce_hook(tp))
    if model.lm_head is not None:
        chunk = vocab_chunk(cfg.vocab_size, n)
        rows = max(0, min(chunk, cfg.vocab_size - tp.rank * chunk))
        model.lm_head = _meta_linear(rows, cfg.hidden_size, False, dtype)
        model.gather_logits = _LogitsGather(tp, chunk, cfg.vocab_size)


def _all_reduce_hook(tp: TensorParallel):
    import torch.distributed as dist

    def hook(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=tp.group)
        return output

    return hook


class _LogitsGather:
    """[R, rows of this rank] float32 logits -> [R, V] on every rank (all-gather)."""

    def __init__(self, tp: TensorParallel, chunk: int, vocab_size: int) -> None:
        self.tp, self.chunk, self.vocab_size = tp, chunk, vocab_size

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if local.shape[1] < self.chunk:  # the last rank of a vocabulary that does not divide
            local = nn.functional.pad(local, (0, self.chunk - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.tp.world)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        full = torch.cat(parts, dim=1)
        return full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size]


def shard_weights(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                  tp: TensorParallel) -> Iterator[tuple[str, torch.Tensor]]:
    """The loader's stream of full Hugging Face tensors, each cut to rank `tp.rank`'s part
    (see the module doc); replicated tensors pass through."""
    n, r = tp.world, tp.rank
    for name, tensor in weights:
        yield name, _shard(config, name, tensor, n, r)


def _rows(tensor: torch.Tensor, n: int, r: int) -> torch.Tensor:
    size = tensor.shape[0] // n
    return tensor[r * size:(r + 1) * size]


def _shard(config: ModelConfig, name: str, tensor: torch.Tensor, n: int, r: int) -> torch.Tensor:
    if name == "lm_head.weight" and not config.tie_word_embeddings:
        chunk = vocab_chunk(config.vocab_size, n)
        return tensor[r * chunk:(r + 1) * chunk]
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return tensor  # the embedding, the final norm (and a tied model's spare lm_head)
    rest = match.group(1)
    if re.fullmatch(r"self_attn\.[qkv]_proj\.(weight|bias)|mlp\.(gate|up)_proj\.weight", rest):
        return _rows(tensor, n, r)  # heads (q: query heads, k/v: KV heads) or MLP width
    if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        size = tensor.shape[1] // n
        return tensor[:, r * size:(r + 1) * size]
    return tensor


def transform(tp: TensorParallel):
    """`build_model`'s transform for rank `tp.rank`: shard the meta model, slice the stream."""
    def apply(model, weights):
        shard_model(model, tp)
        return shard_weights(model.config, weights, tp)

    return apply
