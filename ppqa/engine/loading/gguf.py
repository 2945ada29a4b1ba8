"""GGUF files: metadata -> ModelConfig, tensors -> HF-named torch weights, vocabulary -> tokenizer.

Reads the header with `GGUFFile` (gguf_file.py; the tensors memory-mapped); the `gguf` package
gives the block sizes and the numpy dequantization (imported by the loading modules only, never
by the GPU-side ones). Each tensor is dequantized when the weight iterator reaches it: by torch
on the requested device for the types in `gguf_quants.TYPES` (the plain ones, Q8_0, Q4_0, Q4_1
and the Q4_K/Q5_K/Q6_K k-quants), by `gguf.quants` on the CPU for every other type it knows;
then converted straight to the requested dtype. The bytes of the torch-unpacked types reach a
GPU as byte runs at the tensors' offsets in the file, read through pinned buffers
(`streaming.stream_runs`, as hf.py reads safetensors shards), and unpack there from those bytes;
on the CPU they are read from the memory map (`gguf_quants.dequantize`).
llama.cpp's converter permutes the rows of attn_q/attn_k of `llama` models so that rotary pairs are
adjacent (its "normal" rope); `unpermute_rope_rows` restores Hugging Face's half-split layout.
Qwen2 files use the NEOX rope layout and are stored unpermuted.
The tokenizer is built by `transformers` from the same file (it reads tokens, merges, pre-tokenizer
and chat template from the metadata) once, then saved under `$PPQA_HOME/tokenizers/` and read back
by later processes without `transformers` (`gguf_tokenizer`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import closing
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppqa.engine.loading import gguf_quants
from ppqa.engine.loading.gguf_file import GGUFFile
from ppqa.engine.loading.streaming import CHUNK_BYTES, TensorRun, stream_runs
from ppqa.engine.loading.types import LazyWeights, LoadedModel, ModelLoadError
from ppqa.engine.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# rope_freqs: llama.cpp's per-frequency rope divisors, read into the config's rope_scaling instead.
_IGNORED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors the model does not load)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_name(name: str) -> str:
    """The GGUF name of a Hugging Face tensor name that `hf_name` maps (its inverse)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    names = {hf: g for g, hf in (_LAYER_NAMES if m else _GLOBAL_NAMES).items()}
    return f"blk.{m.group(1)}.{names[m.group(2)]}" if m else names[name]


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs -> HF's two halves.

    The converter viewed each head's rows as (2, head_dim/2) and swapped the axes; the inverse
    views them as (head_dim/2, 2) and swaps back. Works for weights [out, in] and biases [out].
    """
    rows, rest = w.shape[0], w.shape[1:]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _reader(path: Path) -> Any:
    try:
        resolved = path.resolve()  # one cached reader per real file, whatever links point to it
        return _open(str(resolved), resolved.stat().st_mtime_ns)
    except Exception as e:  # noqa: BLE001 -- gguf raises ValueError, IndexError, OSError... on bad files
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file (corrupt or truncated?): "
                             f"{type(e).__name__}: {e}") from e


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """Hugging Face's llama3 `rope_scaling` from llama.cpp's per-frequency divisors (rope_freqs).

    llama.cpp bakes Llama 3.x's scaling into one divisor per rotary frequency; HF describes it with
    four numbers. The largest divisor is the factor; the other three are those of every Llama 3.x
    release. Recompute the divisors from them and accept only a match.
    """
    factor, low, high, original = float(divisors.max()), 1.0, 4.0, 8192
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4):
        raise ModelLoadError(f"{str(path)!r}: its rope frequency factors (rope_freqs) are not Llama 3's "
                             "scaling; load this model from its Hugging Face directory instead")
    return {"rope_type": "llama3", "type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def config_from_gguf(reader: Any, path: Path, tensors: dict[str, Any]) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{str(path)!r}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    rope_scaling = None
    if key("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": key("rope.scaling.type"), "type": key("rope.scaling.type"),
                        "factor": float(key("rope.scaling.factor", 1.0))}
    head_dim = int(key("attention.key_length", hidden // heads))
    if "rope_freqs.weight" in tensors:
        rope_scaling = llama3_rope_scaling(_dequantize(tensors["rope_freqs.weight"]).reshape(-1),
                                           float(key("rope.freq_base", 10000.0)), head_dim, path)
    eos = [_field(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    try:
        return ModelConfig(
            vocab_size=int(key("vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=sorted({int(e) for e in eos if e is not None}),
            name=str(_field(reader, "general.name", path.stem)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{str(path)!r}: GGUF metadata incomplete or invalid for {arch}: {e}") from e


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 tensors come back as read-only views of the memory map; torch wants its own copy.
    return np.array(data, dtype=np.float32, copy=not data.flags.writeable or data.dtype != np.float32
                    ).reshape(tensor.torch_shape)


def _weights(path: Path, config: ModelConfig, arch: str, device: torch.device,
             dtype: torch.dtype, *, streamed: bool | None = None,
             chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The loaded tensors in file order, on `device` in `dtype`. `streamed` (by default: on a
    CUDA device) sends the bytes of the types in `gguf_quants.TYPES` through pinned buffers
    (`streaming.stream_runs`, in reads of `chunk_bytes`) and unpacks them where they land;
    otherwise they go from the memory map one tensor at a time. Tests stream on the CPU too,
    and benchmarks/load_time.py times both ways on a GPU."""
    reader = _reader(path)
    loaded = [(tensor, name) for tensor in reader.tensors
              if (name := hf_name(tensor.name)) is not None]
    if streamed is None:
        streamed = device.type == "cuda"
    runs = [_run(path, tensor) for tensor, _ in loaded
            if streamed and tensor.tensor_type.name in gguf_quants.TYPES]
    in_runs = {run.name for run in runs}
    with closing(stream_runs(runs, device, chunk_bytes=chunk_bytes)) as delivered:
        for tensor, name in loaded:
            try:
                if tensor.name in in_runs:
                    _, raw = next(delivered)
                    weight = gguf_quants.dequantize_bytes(raw, tensor.tensor_type,
                                                          tensor.torch_shape)
                else:
                    weight = gguf_quants.dequantize(tensor.data, tensor.tensor_type,
                                                    tensor.torch_shape, device)
                if weight is None:  # a type torch does not unpack here: gguf's numpy code
                    weight = torch.from_numpy(_dequantize(tensor))
            except Exception as e:  # noqa: BLE001 -- a truncated file or an unknown quant type
                raise ModelLoadError(f"{str(path)!r}: cannot read tensor {tensor.name} "
                                     f"({tensor.tensor_type.name}): {type(e).__name__}: {e}") from e
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
                weight = unpermute_rope_rows(weight, heads)
            yield name, weight.to(device=device, dtype=dtype)


def _run(path: Path, tensor: Any) -> TensorRun:
    """A tensor's bytes in the file, read as they are (the block layout unpacks on the device)."""
    nbytes = tensor.data.nbytes
    return TensorRun(tensor.name, path, tensor.offset, nbytes, torch.uint8, (nbytes,))


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    from ppqa.engine.loading.presets import weight_shapes

    return dict(weight_shapes(config))


def load_gguf(path: Path, *, device: torch.device, dtype: torch.dtype,
              streamed: bool | None = None) -> LoadedModel:
    """The file's model; its weights read as `_weights` says (`streamed`: None for the
    device's own way, True or False to choose; benchmarks/load_time.py compares the two)."""
    reader = _reader(path)
    try:
        tensors = {t.name: t for t in reader.tensors}
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{str(path)!r}: unreadable tensor table: {e}") from e
    config = config_from_gguf(reader, path, tensors)
    arch = _field(reader, "general.architecture")
    expected = _expected_shapes(config)
    found = {hf_name(n): t.torch_shape for n, t in tensors.items() if hf_name(n) is not None}
    missing = sorted(set(expected) - set(found))
    wrong = [f"{n} {found[n]} != {expected[n]}" for n in expected if n in found and found[n] != expected[n]]
    unknown = sorted(n for n in tensors if hf_name(n) is None and n not in _IGNORED)
    if missing or wrong or unknown:
        raise ModelLoadError(f"{str(path)!r} does not match its {arch} metadata: "
                             + "; ".join(filter(None, [
                                 f"missing {', '.join(missing[:5])}" if missing else "",
                                 f"wrong shapes {', '.join(wrong[:5])}" if wrong else "",
                                 f"unexpected tensors {', '.join(unknown[:5])}" if unknown else ""])))
    types = sorted({t.tensor_type.name for t in tensors.values()})
    tokenizer = gguf_tokenizer(path, config.eos_token_ids)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_ids = list(tokenizer.eos_token_ids)

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        return _weights(path, config, arch, device, dtype, streamed=streamed)

    return LoadedModel(config=config, weights=LazyWeights(produce, len(found)), tokenizer=tokenizer,
                       source=f"gguf:{path} ({', '.join(types)})")


def gguf_tokenizer(path: Path, extra_eos_ids: list[int]) -> Any:
    """The file's tokenizer: the copy saved by an earlier process (`saved_tokenizer_dir`) as a
    `JsonTokenizer` (~0.1 s), else built by `transformers` from the metadata (seconds: it
    rebuilds the vocabulary in Python, after a parse of its own), saved where the copy
    checks out, and returned (`json_tokenizer.saved_or_built`)."""
    from ppqa.engine.loading.json_tokenizer import saved_or_built

    return saved_or_built(saved_tokenizer_dir(path), path, lambda: transformers_tokenizer(path),
                          extra_eos_ids=extra_eos_ids)


def saved_tokenizer_dir(path: Path) -> Path:
    """Where the tokenizer of the GGUF file at `path` is saved (`json_tokenizer.saved_dir`,
    keyed by the file's real path, size and modification time)."""
    from ppqa.engine.loading.json_tokenizer import saved_dir

    return saved_dir(path, [path.resolve()])


def transformers_tokenizer(path: Path) -> Any:
    """`transformers`' own tokenizer from the GGUF file's metadata, one per real file and
    modification time for the life of the process (`_hf_tokenizer`)."""
    real = path.resolve()
    return _hf_tokenizer(str(real), real.stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _hf_tokenizer(path: str, mtime_ns: int) -> Any:
    # transformers rebuilds the vocabulary in Python (~4 s for SmolLM2); the result is immutable in
    # use, so one copy per file serves every Engine of the process.
    import transformers

    p = Path(path)
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name,
                                                        local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- transformers raises many kinds on bad metadata
        raise ModelLoadError(f"{path!r}: cannot build the tokenizer from the GGUF metadata: "
                             f"{type(e).__name__}: {e}") from e
    # The file names its BOS and EOS tokens by id; some transformers versions set another
    # (5.17 takes the BOS token for EOS), so the file's ids are put back.
    reader = _reader(p)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    for name in ("bos", "eos"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens) \
                and getattr(hf, f"{name}_token_id") != int(token_id):
            setattr(hf, f"{name}_token", str(tokens[int(token_id)]))
    return hf
