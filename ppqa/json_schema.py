"""JSON answers: a JSON schema checked and turned into the grammar that constrains decoding.

One place for what a schema job means, shared by ingest (which refuses a schema the grammar
library cannot compile, before anything is stored) and the engine (which compiles it against
the model's tokenizer, `engine/runtime/grammar.py`). The library is llguidance, chosen by
measurement (benchmarks/RESULTS.md, "JSON answers: grammar libraries"): it refuses the schema
keywords it cannot enforce instead of ignoring them, so an answer that completes its grammar
validates against the schema. Its import is torch-free and happens only when a schema is used.

Answers are laid out one way: no free whitespace, `, ` between items and `: ` after keys (as
`json.dumps` writes). With free whitespace a model could emit blanks forever and never close
the object; with a fixed layout every answer the grammar completes is short and parses.
"""

from __future__ import annotations

import json
from typing import Any

ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
# The JSON-mode grammar (OpenAI's `response_format: {"type": "json_object"}`): any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def schema_text(schema: dict[str, Any]) -> str:
    """The schema as compact JSON text, key order kept (properties are generated in it): what
    `SamplingParams.json_schema` carries and what the engine caches its compiled grammar by."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def grammar_for(schema: dict[str, Any] | str) -> str:
    """The llguidance grammar of `schema` (a dict or its JSON text), in the fixed layout above;
    ValueError when the schema is not a JSON object."""
    import llguidance

    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR,
                           "key_separator": KEY_SEPARATOR})


def check_json_schema(schema: Any) -> None:
    """ValueError with one line when the grammar library cannot compile `schema` (a keyword it
    does not implement, a type it does not know, a $ref to nowhere)."""
    import llguidance

    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be a JSON object, got {_kind(schema)}")
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_for(schema))
    except ValueError as exc:
        error = str(exc)
    if error:
        first = (error.strip().splitlines() or ["unknown error"])[0]
        raise ValueError(f"the JSON schema cannot be compiled: {first}")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")
