"""One chat completion request body, checked: what a line of an OpenAI Batch file and
`POST /v1/chat/completions` carry.

`parse_chat_body(body)` returns a `ChatRequest` or raises `RequestError` with one line and the
field at fault (`param`, for the API's error body). Supported: `messages` (system, developer,
user and assistant turns; text content), `max_tokens` or `max_completion_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `n`, `response_format` (`text`; `json_schema`: the
answer is JSON that follows the schema; `json_object`: any JSON object; both through
ppqa/json_schema.py). Harmless fields are named and ignored (`model`: the worker's model
answers). Fields that change what an answer means are refused. Defaults follow the
OpenAI API (temperature 1; without a `seed`, samples drawn afresh: `plan.plan_requests` draws
one), except the answer budget: `DEFAULT_MAX_TOKENS`, less if the prompt leaves less room in
the model's context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ppqa.store.params import GenerationParams

DEFAULT_MAX_TOKENS = GenerationParams().max_new_tokens
MAX_CHOICES = 128
MAX_STOP_STRINGS = 4
MAX_SEED = 2**62  # seeds offset per choice must stay within int64

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Named in the ingest summary and otherwise ignored: they do not change the answer.
IGNORED_FIELDS = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key",
                  "safety_identifier", "parallel_tool_calls")
# Accepted only at the value that means "off", the only behaviour ppqa has.
DEFAULT_ONLY = {"stream": False, "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0,
                "presence_penalty": 0, "logit_bias": {}, "stream_options": None, "tools": []}
SUPPORTED = ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
             "stop", "n", "response_format")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class RequestError(ValueError):
    """A request body ppqa cannot answer; `param` names the field (None: the whole body),
    `line` the batch file's line where there is one."""

    def __init__(self, message: str, param: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.line = line


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[tuple[str, str], ...]  # (role, text), roles as the chat template knows them
    max_tokens: int | None  # None: DEFAULT_MAX_TOKENS, or what the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # None: none given (plan_requests draws one)
    stop: tuple[str, ...] = ()
    n: int = 1
    ignored: tuple[str, ...] = ()  # fields present but ignored (IGNORED_FIELDS)
    json_schema: str | None = None  # response_format's schema, as text (ppqa/json_schema.py)

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.messages]


def parse_chat_body(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in body:
        if name in DEFAULT_ONLY:
            if body[name] is not None and body[name] != DEFAULT_ONLY[name]:
                raise RequestError(f"{name}={body[name]!r} is not supported "
                                   f"(only {DEFAULT_ONLY[name]!r})", name)
        elif name not in SUPPORTED and name not in IGNORED_FIELDS:
            raise RequestError(f"unsupported field {name!r} (supported: {', '.join(SUPPORTED)}; "
                               f"ignored: {', '.join(IGNORED_FIELDS)})", name)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_tokens")
    budget_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    budget, seed, n, temperature, top_p = (
        body.get(name) for name in (budget_name, "seed", "n", "temperature", "top_p"))
    json_schema = _response_format(body.get("response_format"))
    if json_schema is not None and body.get("stop") is not None:
        raise RequestError("stop cannot be combined with a JSON response_format (it would cut "
                           "the JSON; the answer ends where the JSON does)", "stop")
    return ChatRequest(
        json_schema=json_schema,
        messages=_messages(body.get("messages")),
        max_tokens=None if budget is None else _whole(budget, budget_name, low=1),
        temperature=1.0 if temperature is None else _number(temperature, "temperature", 0.0, 2.0),
        top_p=1.0 if top_p is None else _top_p(top_p),
        seed=None if seed is None else _whole(seed, "seed", low=0, high=MAX_SEED),
        stop=_stop(body.get("stop")),
        n=1 if n is None else _whole(n, "n", low=1, high=MAX_CHOICES),
        ignored=tuple(name for name in IGNORED_FIELDS if name in body))


def _response_format(value: Any) -> str | None:
    """The schema a `response_format` asks for, as text: `json_schema`'s own schema, or any
    JSON object for `json_object` (OpenAI's JSON mode); None for `text` or no format."""
    from ppqa.json_schema import ANY_OBJECT, check_json_schema, schema_text

    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RequestError(f"response_format must be an object whose type is one of "
                           f"{', '.join(RESPONSE_FORMATS)}, got {value!r:.80}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_text(ANY_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError('response_format of type json_schema needs "json_schema": '
                           '{"name": ..., "schema": {...}}', "response_format.json_schema")
    try:
        check_json_schema(spec["schema"])
    except ValueError as exc:
        raise RequestError(str(exc), "response_format.json_schema.schema") from None
    return schema_text(spec["schema"])


def _messages(raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{param} must be an object with 'role' and 'content'", param)
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise RequestError(f"{param}: unsupported field {unknown[0]!r} (a message has "
                               "role and content)", f"{param}.{unknown[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{param}: unsupported role {role!r} (supported: "
                               f"{', '.join(ROLES)})", f"{param}.role")
        out.append((ROLES[role], _content(message.get("content"), param)))
    return tuple(out)


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                raise RequestError(f"{param}.content[{j}]: only text parts are supported "
                                   '({"type": "text", "text": "..."})', f"{param}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"{param}: 'content' must be a string or a list of text parts",
                       f"{param}.content")


def _whole(value: Any, name: str, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be a whole number, got {value!r}", name)
    if value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name} must be {span}, got {value}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be from {low:g} to {high:g}, got {value}", name)
    return float(value)


def _top_p(value: Any) -> float:
    top_p = _number(value, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be above 0 (use temperature 0 for greedy answers)", "top_p")
    return top_p


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or any(not isinstance(s, str) or not s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of up to "
                           f"{MAX_STOP_STRINGS} of them, got {value!r}", "stop")
    return tuple(stops)
