"""How fast real weights load: a Hugging Face folder or a GGUF file written from dummy weights,
then timed.

`write_hf_folder(spec, folder)` writes what a downloaded model folder holds: config.json,
safetensors shards of at most `shard_bytes` with their index, and the tokenizer, from the
seeded weights of a dummy preset (`dummy:<preset>+bpe`: the folder needs a real tokenizer, so
SmolLM2's is saved with it). `write_gguf_file(spec, path)` writes the same weights as one GGUF
file of F16 or BF16 tensors, laid out as llama.cpp's converter does. `time_load(path)` then
times, each after asking the OS to drop the weight files from its page cache (fsync +
posix_fadvise DONTNEED; with `drop_caches=True` also the whole machine's page cache, as root
only: not on a machine others share):
    load_model(path)       config, shape checks, tokenizer (reads no weights)
    read                   every weight through the loader to the device (hf.py and gguf.py:
                           to a GPU streamed by byte runs, elsewhere memory-mapped), GB/s of the
                           files' bytes; with `baseline` also `mmap_read` (a folder:
                           get_tensor + .to(device); a GGUF file: gguf.py's memory-mapped path)
    Engine(path)           the whole construction: weights, KV pool and the rest
With `cached`, each timing starts with the files in the page cache instead (read once).
`benchmarks/load_time.py` is the command line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ppqa.engine.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def hf_config_json(config: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json as transformers writes it for Llama (or Qwen2 when q/k/v have biases)."""
    qwen = config.attention_bias
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias, "use_sliding_window": False,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": str(dtype).removeprefix("torch."), "_name_or_path": config.name,
    }


def write_hf_folder(spec: str, folder: Path, *, device: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 5 * 10**9,
                    seed: int = 0) -> dict:
    """Write the folder (see the module doc); config.json last, so a folder that has one is
    complete. Returns what was written: bytes, shards, seconds."""
    from safetensors.torch import save_file

    from ppqa.engine.loading.loader import load_model

    loaded = load_model(spec, device=device, dtype=dtype, seed=seed)
    if not hasattr(loaded.tokenizer, "save_pretrained"):
        raise ValueError(f"{spec}: an HF folder needs a real tokenizer; use a dummy:<preset>+bpe "
                         "model (SmolLM2's tokenizer is saved with the weights)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)
    for old in shard_files(folder):
        old.unlink()
    t0 = time.perf_counter()
    shards: list[dict] = [{}]  # per shard: name -> tensor until written, then -> its file
    sizes = [0]
    for name, tensor in loaded.weights:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > shard_bytes:
            path = folder / f"model-{len(shards):05d}.tmp"
            save_file(shards[-1], str(path), metadata={"format": "pt"})
            shards[-1] = {n: path for n in shards[-1]}  # written: keep only the names
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.to("cpu").contiguous()
        sizes[-1] += nbytes
    path = folder / f"model-{len(shards):05d}.tmp"
    save_file(shards[-1], str(path), metadata={"format": "pt"})
    total = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):  # the HF naming: model-0000i-of-0000n.safetensors
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (folder / f"model-{i + 1:05d}.tmp").replace(folder / final)
        weight_map.update({n: final for n in shard})
    (folder / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=1))
    loaded.tokenizer.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(hf_config_json(loaded.config, dtype), indent=1))
    seconds = time.perf_counter() - t0
    return {"spec": spec, "folder": str(folder), "bytes": sum(sizes), "shards": total,
            "write_s": seconds, "write_gb_per_s": sum(sizes) / seconds / 1e9}


def write_gguf_file(spec: str, path: Path, *, device: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict:
    """Write the GGUF file (see the module doc) of a preset without rope scaling, under a
    temporary name renamed at the end, so a file at `path` is complete. Its tokenizer is a
    byte-level vocabulary of its own: the weights are what is timed. Returns bytes, seconds."""
    import gguf
    import numpy as np

    from ppqa.engine.loading.gguf import gguf_name
    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.loading.presets import weight_shapes

    kinds = {torch.float16: gguf.GGMLQuantizationType.F16,
             torch.bfloat16: gguf.GGMLQuantizationType.BF16}
    if dtype not in kinds:
        raise ValueError(f"a GGUF file is written in float16 or bfloat16, not {dtype}")
    loaded = load_model(spec, device=device, dtype=dtype, seed=seed)
    config = loaded.config
    if config.rope_scaling is not None:
        raise ValueError(f"{spec}: its rope scaling would need llama.cpp's rope_freqs tensor")
    arch = "qwen2" if config.attention_bias else "llama"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(str(partial), arch)
    w.add_name(config.name)
    w.add_vocab_size(config.vocab_size)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    vocab = _byte_vocab()
    w.add_token_list(vocab)
    w.add_token_types([3] + [1] * (len(vocab) - 1))
    w.add_token_merges(["h e", "Ġ t", "Ġt he"])  # transformers' GGUF reader wants merges
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    total = 0
    for name, shape in weight_shapes(config):
        nbytes = int(np.prod(shape)) * 2
        w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float16), nbytes,
                          raw_dtype=kinds[dtype])
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, tensor in loaded.weights:  # weight_shapes' order, as the table above
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = _llama_cpp_rows(tensor, config.num_heads if ".q_proj." in name
                                     else config.num_kv_heads)
        w.write_tensor_data(tensor.contiguous().view(torch.uint8).cpu().numpy())
    w.close()
    partial.replace(path)
    seconds = time.perf_counter() - t0
    return {"spec": spec, "file": str(path), "bytes": total, "write_s": seconds,
            "write_gb_per_s": total / seconds / 1e9}


def _byte_vocab() -> list[str]:
    """An end-of-text token, the 256 byte-level tokens (GPT-2's byte alphabet) and three merges'."""
    from tokenizers.pre_tokenizers import ByteLevel

    return ["<|endoftext|>"] + sorted(ByteLevel.alphabet()) + ["he", "Ġt", "Ġthe"]


def _llama_cpp_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter stores them (gguf.unpermute_rope_rows undoes it)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def weight_files(path: Path) -> list[Path]:
    """The files whose bytes are the weights: a GGUF file itself, or a folder's shards."""
    return [path] if path.is_file() else shard_files(path)


def evict(path: Path, drop_caches: bool = False) -> str:
    """Ask the OS to drop the weight files from its page cache; says what was tried and what
    worked."""
    done = []
    try:
        for file in weight_files(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        done.append("fadvise")
    except (OSError, AttributeError) as exc:
        done.append(f"fadvise failed ({exc})")
    if drop_caches:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done.append("drop_caches")
        except OSError as exc:  # not root, or a sandbox without it
            done.append(f"drop_caches failed ({exc.strerror})")
    return ", ".join(done)


def warm(path: Path) -> str:
    """Read every weight file through once, so that the page cache holds them (a second run's
    case)."""
    for file in weight_files(path):
        with open(file, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return "read once"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mmap_read(folder: Path, device: torch.device, dtype: torch.dtype) -> int:
    """Every weight read the way the loader reads CPU weights, onto `device`: safetensors'
    memory-mapped `get_tensor`, then `.to(device, dtype)` one tensor at a time (the baseline
    the GPU's streamed reads are measured against)."""
    from safetensors import safe_open

    count = 0
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name).to(device=device, dtype=dtype)
                count += 1
                del tensor
    _sync(device)
    return count


def mmap_read_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[int, float]:
    """Every weight of the GGUF file through gguf.py's memory-mapped path, onto `device` (on a
    GPU: each tensor's bytes `.to(device)` from the memory map, the baseline of its streamed
    reads): tensors and seconds, the header and tokenizer read before the clock starts. The
    loader's cached reader is dropped after, so that its memory map no longer holds the pages
    it touched and a later `evict` can drop them."""
    from ppqa.engine.loading import gguf

    loaded = gguf.load_gguf(path, device=device, dtype=dtype, streamed=False)
    timed = _read_through(loaded.weights, device)
    gguf._open.cache_clear()
    return timed


def _read_through(weights, device: torch.device) -> tuple[int, float]:
    """Take every (name, tensor) of `weights`, each dropped at once: how many, and seconds
    until the device's queued work is done."""
    t0 = time.perf_counter()
    count = 0
    for _, tensor in weights:
        count += 1
        del tensor
    _sync(device)
    return count, time.perf_counter() - t0


def time_load(path: Path, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
              engine: bool = True, drop_caches: bool = False, cached: bool = False,
              baseline: bool = False) -> dict:
    """Time the steps of the module doc on `path` (a folder or a GGUF file); seconds and GB/s.
    Each timing starts with the weight files out of the page cache, or with `cached` in it
    (read through once). `baseline` also times the memory-mapped read under the same
    condition."""
    from ppqa.engine.loading.loader import load_model

    def prepare() -> str:
        return warm(path) if cached else evict(path, drop_caches)

    dev = torch.device(device)
    file_bytes = sum(p.stat().st_size for p in weight_files(path))
    out: dict = {"file" if path.is_file() else "folder": str(path), "device": str(dev),
                 "dtype": str(dtype), "file_bytes": file_bytes,
                 "page_cache": "warm" if cached else "cold"}
    out["prepared"] = prepare()
    t0 = time.perf_counter()
    loaded = load_model(str(path), device=dev, dtype=dtype)
    out["load_model_s"] = time.perf_counter() - t0
    out["tensors"], out["read_s"] = _read_through(loaded.weights, dev)
    out["read_gb_per_s"] = file_bytes / out["read_s"] / 1e9
    if baseline:
        prepare()
        if path.is_file():
            _, out["mmap_read_s"] = mmap_read_gguf(path, dev, dtype)
        else:
            t0 = time.perf_counter()
            mmap_read(path, dev, dtype)
            out["mmap_read_s"] = time.perf_counter() - t0
        out["mmap_read_gb_per_s"] = file_bytes / out["mmap_read_s"] / 1e9
    if engine:
        from ppqa import Engine

        del loaded
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        prepare()
        t0 = time.perf_counter()
        eng = Engine(str(path), device=str(dev), dtype=dtype)
        _sync(dev)
        out["engine_s"] = time.perf_counter() - t0
        out["engine_gb_per_s"] = file_bytes / out["engine_s"] / 1e9
        out["kv_capacity_tokens"] = eng.kv_capacity
    return out
