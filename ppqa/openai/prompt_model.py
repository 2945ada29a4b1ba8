"""What planning needs of a model (`PromptModel`): its name, tokenizer and context length.

`ppqa ingest --openai-batch` and a `ppqa serve` without `--worker` load only that
(`load_prompt_model`: the loader's weights are lazy, so nothing but the config and tokenizer
is read); a server with a worker takes it from its engine (`engine_prompt_model`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ppqa.store.errors import InputError


@dataclass(frozen=True)
class PromptModel:
    name: str  # the jobs ask for this model, so that only workers running it take them
    tokenizer: object  # ppqa.engine.loading.tokenizer.Tokenizer
    context_tokens: int


def load_prompt_model(spec: str) -> PromptModel:
    """The tokenizer and context of model `spec` (as `ppqa run --model` takes it)."""
    from ppqa.engine.loading.loader import load_model  # torch: only when a batch is planned

    try:
        loaded = load_model(spec)
    except (ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"cannot load the tokenizer of model {spec!r}: {first}") from None
    return PromptModel(spec, loaded.tokenizer, loaded.config.max_position_embeddings)


def engine_prompt_model(engine, spec: str) -> PromptModel:
    """The same from a loaded Engine (its KV pool may hold less than the context), with a copy
    of its tokenizer: the server's threads plan while the worker's thread tokenizes, and a
    `tokenizers` object is not meant to be shared between threads."""
    context = min(engine.model_config.max_position_embeddings, engine.kv_capacity)
    return PromptModel(spec, copy.deepcopy(engine.tokenizer), context)
