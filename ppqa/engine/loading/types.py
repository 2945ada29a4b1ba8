"""The loaders' shared types: what every model source yields, and the error it raises.

Below the loader and its sources (GGUF, HF folders, presets, the model cache), so that none of
them imports another to name these. No torch at import time: the model cache uses the error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppqa.engine.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from ppqa.engine.loading.tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A model that cannot be loaded: unknown name, missing or corrupt file, unsupported format."""


class LazyWeights:
    """An iterable of (name, tensor) that re-opens its source on every iteration.

    Each iteration produces tensors one at a time; nothing is kept between iterations.
    """

    def __init__(self, produce: Callable[[], Iterator[tuple[str, torch.Tensor]]], count: int) -> None:
        self._produce = produce
        self.count = count  # number of tensors one iteration yields

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._produce()

    def __len__(self) -> int:
        return self.count


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Iterable[tuple[str, torch.Tensor]]  # HF Llama names; requested dtype and device; lazy
    tokenizer: Tokenizer
    source: str  # human description, e.g. "gguf:/path (Q4_1)"

    def __post_init__(self) -> None:
        if not isinstance(self.config, ModelConfig):
            raise TypeError(f"LoadedModel.config must be a ModelConfig, got {type(self.config).__name__}")
        if not self.source:
            raise ValueError("LoadedModel.source must describe where the model came from")
