"""Model loading: a spec string in, a config + lazy weights + tokenizer out.

`load_model(spec)` accepts
  - an embedded name (`smollm2`): fetched into the model cache on first use (`model_cache.py`),
    then loaded as a GGUF file;
  - a path to a `.gguf` file (`gguf.py`, dequantized with the `gguf` package);
  - a path to a Hugging Face directory (`hf.py`: config.json + safetensors);
  - `dummy:<preset>` (`presets.py`: seeded random weights, no files), with the byte tokenizer;
    `dummy:<preset>+bpe` gives it SmolLM2's BPE tokenizer instead (`bpe.py`) and a vocabulary of
    that size.
Every source yields the same thing: a `ModelConfig` and weights under Hugging Face Llama names,
already in the requested dtype and on the requested device, produced one tensor at a time so the
engine (which builds its model on the meta device) never holds two copies of a large model.

This module imports neither `gguf` nor `platformdirs` at the top: the GPU machine lacks both, and
`dummy:` models must load there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ppqa.engine.loading.types import LazyWeights, LoadedModel, ModelLoadError

DUMMY_PREFIX = "dummy:"
BPE_SUFFIX = "+bpe"


def preset_names() -> list[str]:
    """Names usable as `dummy:<name>`."""
    from ppqa.engine.loading.presets import preset_names as names

    return names()


def load_model(spec: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> LoadedModel:
    """Load the model named by `spec` (see the module docstring); `seed` only affects dummy weights."""
    from ppqa.engine.loading import model_cache

    device = torch.device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    spec = str(spec).strip()
    if spec.startswith(DUMMY_PREFIX):
        return _load_dummy(spec[len(DUMMY_PREFIX):], device=device, dtype=dtype, seed=seed)
    if spec in model_cache.EMBEDDED:
        path = model_cache.ensure(spec)
        return _load_path(path, device=device, dtype=dtype)
    path = Path(spec).expanduser()
    if path.exists():
        return _load_path(path, device=device, dtype=dtype)
    cached = model_cache.models_dir() / spec
    if spec and "/" not in spec and cached.exists():
        return _load_path(cached, device=device, dtype=dtype)
    raise ModelLoadError(
        f"unknown model {spec!r}: not an embedded model ({', '.join(model_cache.EMBEDDED)}), not an "
        f"existing .gguf file or Hugging Face directory, not a model in the cache "
        f"({model_cache.models_dir()}), and not dummy:<preset>[+bpe] (presets: {', '.join(preset_names())}). "
        f"Run `ppqa models list` to see what is available."
    )


def _load_path(path: Path, *, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if path.is_dir():
        if (path / "config.json").exists():
            from ppqa.engine.loading.hf import load_hf_dir

            return load_hf_dir(path, device=device, dtype=dtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # a cache folder such as models/smollm2/
            path = ggufs[0]
        else:
            raise ModelLoadError(
                f"{str(path)!r} is a directory without config.json"
                + (f" and with {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}): "
                   "give the path of one" if ggufs else
                   ": expected a Hugging Face model directory (config.json + *.safetensors) "
                   "or a directory holding one .gguf file")
            )
    if path.suffix.lower() == ".gguf":
        from ppqa.engine.loading.gguf import load_gguf

        return load_gguf(path, device=device, dtype=dtype)
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
        raise ModelLoadError(
            f"{str(path)!r} is a pickled checkpoint; ppqa never unpickles weights (it can run code). "
            "Convert it to safetensors in a Hugging Face directory, or use a .gguf file."
        )
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face model directory")


def _load_dummy(name: str, *, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    from ppqa.engine.loading import presets

    base = name.removesuffix(BPE_SUFFIX)
    if base not in presets.PRESETS:
        raise ModelLoadError(f"unknown dummy preset {base!r}: available presets are "
                             f"{', '.join(presets.preset_names())} (use dummy:<preset>, or "
                             f"dummy:<preset>{BPE_SUFFIX} for SmolLM2's BPE tokenizer)")
    config, init_std, tokenizer = presets.preset_config(base)
    about = f"random, seed {seed}, std {init_std}"
    if name != base:
        from ppqa.engine.loading.bpe import BPE_MODEL, bpe_tokenizer

        tokenizer = bpe_tokenizer()
        config = presets.with_tokenizer(config, tokenizer, BPE_SUFFIX)
        about += f", {BPE_MODEL}'s BPE tokenizer, vocabulary {config.vocab_size}"
    count = sum(1 for _ in presets.weight_shapes(config))

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        return presets.dummy_weights(config, init_std, device=device, dtype=dtype, seed=seed)

    return LoadedModel(config=config, weights=LazyWeights(produce, count), tokenizer=tokenizer,
                       source=f"dummy:{name} ({about})")
