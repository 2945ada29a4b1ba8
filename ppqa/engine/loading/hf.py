"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> weights, tokenizer.

Weights come from `model.safetensors` or from the shards listed in `model.safetensors.index.json`,
converted to the requested dtype and device as the iterator reaches them: to a GPU, each shard's
tensors as byte runs read from the header's offsets through pinned buffers
(`streaming.stream_runs`); elsewhere through safetensors' `safe_open`, one tensor at a time,
memory-mapped. Pickled checkpoints (.bin/.pt) are refused:
unpickling runs arbitrary code. The tokenizer and its chat template come from the directory through
`transformers.AutoTokenizer` with `local_files_only=True` (never the hub), once: a checked copy is
saved under `$PPQA_HOME/tokenizers/` and read back without `transformers` afterwards; extra EOS
ids (Llama 3's <|eot_id|>...) come from generation_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ppqa.engine.loading.streaming import TensorRun, stream_runs
from ppqa.engine.loading.types import LazyWeights, LoadedModel, ModelLoadError
from ppqa.engine.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The files AutoTokenizer may build a folder's tokenizer from (config.json picks its class).
_TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                      "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "config.json")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def config_from_hf(raw: dict, where: Path) -> ModelConfig:
    """Map a transformers config.json (v4 or v5 spelling) onto ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{str(where)!r}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type") or scaling.get("type")
        scaling["rope_type"] = scaling["type"] = kind
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if sliding is not None and int(sliding) < max_pos:
        raise ModelLoadError(f"{str(where)!r}: sliding-window attention ({sliding} of {max_pos} "
                             "positions) is not supported by ppqa's engine")
    heads = int(raw["num_attention_heads"])
    try:
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or 0),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama says so in attention_bias.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_list(raw.get("eos_token_id")),
            name=str(raw.get("_name_or_path") or where.name),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{str(where)!r}: config.json is incomplete or invalid: {e}") from e


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    from safetensors import safe_open

    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{str(index)!r} has no weight_map")
        files = {name: directory / shard for name, shard in weight_map.items()}
        absent = sorted({p.name for p in files.values() if not p.exists()})
        if absent:
            raise ModelLoadError(f"{str(index)!r} lists shards that are missing: {', '.join(absent)}")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise ModelLoadError(
            f"{str(directory)!r} has no *.safetensors weights"
            + (f"; it has pickled weights ({', '.join(pickled)}), which ppqa never loads because "
               "unpickling can run code. Convert them to safetensors." if pickled else ".")
        )
    files = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                files.update({name: shard for name in f.keys()})
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            raise ModelLoadError(f"{str(shard)!r} is not a readable safetensors file: {e}") from e
    return files


def _weights(files: dict[str, Path], names: list[str], device: torch.device,
             dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named tensor on `device` in `dtype`: to a GPU through pinned buffers
    (`streaming.stream_runs`), elsewhere from the memory-mapped file."""
    runs = _runs(files, names) if device.type == "cuda" else None
    if runs is not None:
        try:
            for name, tensor in stream_runs(runs, device):
                yield name, tensor.to(dtype)
        except OSError as e:
            raise ModelLoadError(f"cannot read weights: {e}") from e
        return
    from safetensors import safe_open

    for shard, shard_names in _by_shard(files, names).items():
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in shard_names:
                    yield name, f.get_tensor(name).to(device=device, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{str(shard)!r}: cannot read weights: {e}") from e


def _by_shard(files: dict[str, Path], names: list[str]) -> dict[Path, list[str]]:
    """The names grouped by the shard that holds each, shards in order of first mention."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def _header(shard: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    begins: an 8-byte little-endian length, then that many bytes of JSON."""
    with open(shard, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _runs(files: dict[str, Path], names: list[str]) -> list[TensorRun] | None:
    """The named tensors' byte runs, shard by shard in file order; None where a tensor's dtype
    is not a float type (the memory-mapped path reads those). Offsets past a shard's end are
    a ModelLoadError."""
    runs = []
    for shard, shard_names in _by_shard(files, names).items():
        try:
            header, data = _header(shard)
            size = shard.stat().st_size
            entries = [(name, header[name]) for name in shard_names]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{str(shard)!r} is not a readable safetensors file: {e}") from e
        for name, entry in sorted(entries, key=lambda e: e[1]["data_offsets"][0]):
            dtype = _SAFETENSORS_FLOATS.get(entry["dtype"])
            if dtype is None:
                return None
            begin, end = entry["data_offsets"]
            if data + end > size:
                raise ModelLoadError(f"{str(shard)!r}: tensor {name} runs past the end of the "
                                     f"file ({data + end} > {size} bytes): a truncated download?")
            runs.append(TensorRun(name, shard, data + begin, end - begin, dtype,
                                  tuple(entry["shape"])))
    return runs


def _check_shapes(files: dict[str, Path], expected: dict[str, tuple[int, ...]], where: Path) -> None:
    from safetensors import safe_open

    wrong = []
    for shard in sorted(set(files[n] for n in expected)):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in (n for n in expected if files[n] == shard):
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        wrong.append(f"{name} {shape} != {expected[name]}")
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{str(shard)!r} is not a readable safetensors file: {e}") from e
    if wrong:
        raise ModelLoadError(f"{str(where)!r}: weights do not match config.json: {'; '.join(wrong[:5])}")


def load_hf_dir(directory: Path, *, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from ppqa.engine.loading.presets import weight_shapes

    raw = _read_json(directory / "config.json")
    config = config_from_hf(raw, directory)
    expected = dict(weight_shapes(config))
    files = _tensor_files(directory)
    missing = sorted(set(expected) - set(files))
    if missing:
        raise ModelLoadError(f"{str(directory)!r}: weights missing for "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    _check_shapes(files, expected, directory)
    tokenizer = hf_dir_tokenizer(directory, config)
    if tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_ids = list(tokenizer.eos_token_ids)
    names = list(expected)  # lm_head of a tied model and extra tensors are not loaded

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        return _weights(files, names, device, dtype)

    shards = sorted({p.name for p in files.values()})
    return LoadedModel(config=config, weights=LazyWeights(produce, len(names)), tokenizer=tokenizer,
                       source=f"hf:{directory} ({len(shards)} safetensors file{'s' * (len(shards) > 1)})")


def hf_dir_tokenizer(directory: Path, config: ModelConfig) -> Any:
    """The folder's tokenizer as `transformers.AutoTokenizer` builds it, with the EOS ids of
    config.json and generation_config.json. Built once, then read back from a checked copy
    (`json_tokenizer.saved_or_built`, keyed by the files it is built from): a worker's later
    start-ups import no `transformers` for it."""
    from ppqa.engine.loading.json_tokenizer import saved_dir, saved_or_built

    def build() -> Any:
        try:
            import transformers

            return transformers.AutoTokenizer.from_pretrained(str(directory),
                                                              local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{str(directory)!r}: cannot load its tokenizer "
                                 f"(tokenizer.json / tokenizer_config.json): "
                                 f"{type(e).__name__}: {e}") from e

    extra = list(config.eos_token_ids)
    generation = directory / "generation_config.json"
    if generation.exists():
        extra += _as_id_list(_read_json(generation).get("eos_token_id"))
    sources = [directory / name for name in _TOKENIZER_SOURCES if (directory / name).is_file()]
    return saved_or_built(saved_dir(directory, sources), directory, build, extra_eos_ids=extra)
