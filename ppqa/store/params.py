"""Generation parameters of a job, checked once at ingest and stored as JSON in `jobs.params`.

The CLI builds them from options (or a batch line), the store hashes them into the job key and
the worker reads them back with `GenerationParams.from_dict` to drive the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ppqa.choices import check_norm
from ppqa.modes import check_mode
from ppqa.store.errors import InputError

MAX_SEED = 2**63 - 1  # the sampler's seeds are int64 (engine/runtime/sampling.py)
MAX_NEW_TOKENS = 1_000_000  # beyond any model's context
MAX_SAMPLES = 1024  # answers per question


@dataclass(frozen=True)
class GenerationParams:
    template: str = "qa"
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy decoding
    top_p: float = 1.0
    seed: int = 0
    mode: str = "auto"
    model: str | None = None  # None: whatever model the worker runs
    stop: tuple[str, ...] = ()  # an answer ends before the first of these strings
    # A JSON schema every answer follows (ppqa/json_schema.py), as its compact JSON text so the
    # params stay hashable; given as a dict or text, stored in the job as the object.
    json_schema: str | None = None
    # How the choices of questions that have them are compared (ppqa/choices.py).
    choice_norm: str = "none"
    # Answers drawn per question, each from its own seed (`config.sample_seed`); more than one
    # needs a temperature above 0. A question with choices is scored once and its samples
    # drawn from its choices' probabilities at the temperature (ppqa/choices.py).
    samples: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise InputError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.template, str) or not self.template.strip():
            raise InputError("template must be a non-empty name or path")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InputError(f"max_new_tokens must be a whole number, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise InputError(f"max_new_tokens must be at most {MAX_NEW_TOKENS:,}, "
                             f"got {self.max_new_tokens}")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise InputError(f"temperature must be a number from 0 to 100, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed <= MAX_SEED:
            raise InputError(f"seed must be a whole number from 0 to {MAX_SEED}, "
                             f"got {self.seed!r}")
        try:
            check_mode(self.mode)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise InputError(f"model must be a non-empty name or path, got {self.model!r}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _checked_schema(self.json_schema))
            if self.stop:
                raise InputError("stop strings cannot be combined with a JSON schema (they "
                                 "would cut the JSON); the answer ends where the JSON does")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) \
                or not 1 <= self.samples <= MAX_SAMPLES:
            raise InputError(f"samples must be a whole number from 1 to {MAX_SAMPLES}, "
                             f"got {self.samples!r}")
        if self.samples > 1 and self.temperature == 0:
            raise InputError(f"{self.samples} samples need a temperature above 0: greedy "
                             "decoding gives the same answer every time")
        try:
            check_norm(self.choice_norm)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.stop:  # jobs without stop strings keep the params (and job key) they had
            del data["stop"]
        else:
            data["stop"] = list(self.stop)
        if self.json_schema is None:  # likewise for jobs without a schema
            del data["json_schema"]
        else:
            data["json_schema"] = json.loads(self.json_schema)
        if self.choice_norm == "none":  # likewise jobs that compare choices by their sums
            del data["choice_norm"]
        if self.samples == 1:  # and jobs of one answer per question
            del data["samples"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationParams:
        """Read stored params, ignoring keys a newer ppqa may have added."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _checked_schema(schema: Any) -> str:
    """A schema (a dict, or its JSON text) that the grammar library compiles, as its text."""
    from ppqa.json_schema import check_json_schema, schema_text

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InputError(f"json_schema is not valid JSON ({exc})") from None
    try:
        check_json_schema(schema)
    except ValueError as exc:
        raise InputError(f"json_schema: {exc}") from None
    return schema_text(schema)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
