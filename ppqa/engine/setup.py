"""Building an engine's parts: resolve device, dtype and backend, load the model, size the KV pool.

`build_parts(config, device, dtype, load)` resolves the "auto"/None fields of `EngineConfig`, calls
`load(device, dtype, seed)` for a `LoadedModel`, builds the model from its weight stream (on a GPU
while a thread makes the process's first use of Triton, cuBLAS and cuDNN: engine/first_use.py),
then sizes the KV pool from the remaining memory (GPU: `mem_fraction` of what is free after the
weights; CPU: `kv_token_budget` tokens), and creates the req_to_token table, the document cache,
the attention backend (torch, or Triton or FlashInfer imported lazily) and the runner. `Engine`
keeps the result.

With `tensor_parallel` N > 1 this process is one rank of an initialized torch.distributed group:
the model is built as this rank's shard (`engine/parallel/tensor_parallel.py`), the KV pool and
the backend hold this rank's heads only, every rank takes the smallest rank's pool size, and a
`Lockstep` keeps the ranks' sessions together (`engine/parallel/lockstep.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ppqa.config import EngineConfig, default_prefill_tokens
from ppqa.engine import first_use
from ppqa.engine.devices import resolve_device
from ppqa.engine.runtime.document_cache import DocumentCache
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.model.llama import LlamaModel, build_model
from ppqa.engine.runtime.runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    model_name: str
    config: EngineConfig  # with device, dtype and attention_backend resolved
    device: torch.device
    dtype: torch.dtype
    model: LlamaModel
    tokenizer: object
    pool: KVPool
    table: ReqToTokenTable
    docs: DocumentCache
    backend: object
    runner: ModelRunner
    lockstep: object = None  # engine/parallel/lockstep.Lockstep under tensor parallelism
    # the GPU libraries' first use, beside loading (empty where none was made)
    first_use: first_use.FirstUse = field(default_factory=first_use.FirstUse)


def _pool_slots(config: EngineConfig, device: torch.device, bytes_per_slot: int) -> int:
    if device.type != "cuda":
        return config.kv_token_budget + 1  # + the sink slot 0
    from ppqa.engine import precompile

    precompile.wait()  # compile helpers hold GPU memory until they exit
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    return max(2, int(free * config.mem_fraction) // bytes_per_slot)


def _check_flashinfer(device: torch.device, config: EngineConfig) -> None:
    """Before any weights load: the FlashInfer backend's needs, each with its reason."""
    if device.type != "cuda":
        raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
    if config.cuda_graphs:
        raise ValueError("attention_backend 'flashinfer' runs without CUDA graphs (FlashInfer "
                         "plans each step on the host): set cuda_graphs=False or leave it None")
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise ValueError("attention_backend 'flashinfer' needs the flashinfer package (its "
                         "0.2.x source release; see benchmarks/flashinfer_device.sh)") from e


def _make_backend(config: EngineConfig, device: torch.device, pool: KVPool, model: LlamaModel):
    attn = model.layers[0].self_attn  # this rank's heads (all of them without tensor parallelism)
    args = (pool, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.head_dim ** -0.5)
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from ppqa.engine.attention.triton_backend import TritonBackend

        return name, TritonBackend(*args, overlap=config.overlap_cascade)
    if name == "flashinfer":
        from ppqa.engine.attention.flashinfer_backend import FlashInferBackend

        return name, FlashInferBackend(*args, overlap=config.overlap_cascade)
    from ppqa.engine.attention.torch_backend import TorchBackend

    return name, TorchBackend(*args)


def build_parts(config: EngineConfig | None, device: str | None, dtype: object,
                load: Callable[[torch.device, torch.dtype, int], object], *,
                model_name: str) -> EngineParts:
    config = config or EngineConfig()
    overrides = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    config = dataclasses.replace(config, **overrides)
    dev = resolve_device(config.device)
    dtype_name = config.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    torch_dtype = _DTYPES[dtype_name]
    if config.attention_backend == "flashinfer":
        _check_flashinfer(dev, config)

    tp = lockstep = transform = None
    if config.tensor_parallel > 1:
        from ppqa.engine.parallel import tensor_parallel
        from ppqa.engine.parallel.lockstep import Lockstep

        tp = tensor_parallel.TensorParallel.from_process_group(config.tensor_parallel, dev)
        lockstep, transform = Lockstep(tp), tensor_parallel.transform(tp)
    early = first_use.prepare(dev)  # Triton's own key, hashed while the weights load
    loaded = load(dev, torch_dtype, config.seed)
    if tp is not None:
        tensor_parallel.check_divisible(loaded.config, tp.world)  # before any weight loads
    mc = loaded.config
    libraries = first_use.start(dev, torch_dtype, mc.hidden_size, mc.num_heads, mc.head_dim,
                                mc.rms_norm_eps, mc.vocab_size, prepared=early)
    model = build_model(loaded.config, loaded.weights, device=dev, dtype=torch_dtype,
                        transform=transform)
    libraries.join()  # before the pool's size is read from the memory free
    mc, kv_heads = model.config, model.layers[0].self_attn.num_kv_heads
    num_slots = _pool_slots(config, dev, KVPool.bytes_per_slot(mc.num_layers, kv_heads,
                                                               mc.head_dim, torch_dtype))
    if lockstep is not None:
        num_slots = lockstep.agree_min(num_slots, dev)
    pool = KVPool(num_slots, mc.num_layers, kv_heads, mc.head_dim, dtype=torch_dtype, device=dev)
    row_len = config.max_row_tokens or 4 * mc.max_position_embeddings
    table = ReqToTokenTable(config.wide_requests, min(num_slots, row_len), dev)
    backend_name, backend = _make_backend(config, dev, pool, model)
    # Graphs need a backend that never syncs with the host inside a step: the Triton one.
    graphs = (dev.type == "cuda" and backend_name == "triton" if config.cuda_graphs is None
              else config.cuda_graphs)
    config = dataclasses.replace(config, device=str(dev), dtype=dtype_name,
                                 attention_backend=backend_name, cuda_graphs=graphs,
                                 max_prefill_tokens=config.max_prefill_tokens
                                 or default_prefill_tokens(dev.type))
    if dev.type == "cuda":
        # Beside a GPU the host's tensor work is bookkeeping of a few thousand elements, which
        # intra-op threads do not speed up; while the tokenizer's pool holds the cores, an op
        # that goes parallel waits for them and the GPU idles (benchmarks/host_threads.py;
        # results/cpu/host_threads.json). Set once the weights are loaded.
        torch.set_num_threads(1)
    return EngineParts(model_name=model_name, config=config, device=dev, dtype=torch_dtype,
                       model=model, tokenizer=loaded.tokenizer, pool=pool, table=table,
                       docs=DocumentCache(pool.allocator, pool.copy_slots), backend=backend,
                       runner=ModelRunner(model, pool, table, backend, dev,
                                          cuda_graphs=graphs and dev.type == "cuda"),
                       lockstep=lockstep, first_use=libraries)
