"""ppqa: answer many questions about one long document with a local LLM, fast.

Public API (ARCHITECTURE.md maps the rest):

    from ppqa import Engine, SamplingParams
    eng = Engine("smollm2", device="cpu")
    answers = eng.answer(document, questions, mode="parallel")

Names are exported lazily (module `__getattr__`), so `import ppqa` and the CLI's light commands
never import torch; it is loaded on first use of `Engine` (or the other engine types).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "ppqa.engine.engine",
    "EngineConfig": "ppqa.config",
    "SamplingParams": "ppqa.config",
    "Answer": "ppqa.engine.outputs",
    "QuestionRequest": "ppqa.engine.outputs",
    "RunStats": "ppqa.engine.outputs",
    "PromptTooLongError": "ppqa.engine.outputs",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time the names load lazily
    from ppqa.config import EngineConfig, SamplingParams
    from ppqa.engine.engine import Engine
    from ppqa.engine.outputs import Answer, PromptTooLongError, QuestionRequest, RunStats


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ppqa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
