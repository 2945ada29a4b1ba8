"""Reading an OpenAI Batch input file: one `{"custom_id", "method", "url", "body"}` a line.

`read_batch_requests(text, label)` checks every line (a JSON object with exactly those keys,
`method` POST, `url` the batch's endpoint, a unique non-empty `custom_id`, a body that
`parse_chat_body` accepts) and returns them as `PlannedRequest`s, or raises `BatchFileError`
listing every problem (up to MAX_ERRORS) with its line: all or nothing, as `ppqa ingest --batch`.
`plan_batch_file` adds the planning (`plan.py`: a prompt too long for the model is refused here).
The CLI reads the file with `ppqa.files.inputs.read_text`; the server decodes uploaded bytes
with `decode_batch_file`, which refuses the same things (binary data, bad UTF-8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ppqa.files.inputs import split_lines, strict_json
from ppqa.openai.chat_request import RequestError, parse_chat_body
from ppqa.openai.plan import BatchPlan, PlannedRequest, plan_requests
from ppqa.openai.prompt_model import PromptModel
from ppqa.store.errors import InputError
from ppqa.store.openai_batches import CHAT_ENDPOINT

LINE_KEYS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID = 200  # the length of a question id in the store
MAX_ERRORS = 100


@dataclass(frozen=True)
class LineError:
    line: int | None
    message: str  # with "label:line: " in front
    param: str | None = None
    code: str = "invalid_request"

    def to_dict(self) -> dict:
        """As an entry of a failed batch's `errors.data`."""
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


class BatchFileError(InputError):
    """A batch file with problems; the first is the message, `errors` holds them all."""

    def __init__(self, errors: list[LineError]) -> None:
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" \
            if len(errors) > 1 else ""
        super().__init__(errors[0].message + more)
        self.errors = errors


def decode_batch_file(data: bytes, label: str) -> str:
    """The UTF-8 text of an uploaded batch file; BatchFileError for binary or bad bytes."""
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise BatchFileError([LineError(line, f"{label}:{line}: binary data (NUL byte at "
                                              f"offset {nul}), expected JSON lines")])
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise BatchFileError([LineError(line, f"{label}:{line}: not valid UTF-8 (byte "
                                              f"0x{data[exc.start]:02x} at offset {exc.start})")])


def plan_batch_file(text: str, label: str, model: PromptModel, *, priority: int = 0) -> BatchPlan:
    """A batch file's text checked (`read_batch_requests`) and planned into jobs; every
    problem is a BatchFileError naming the line."""
    requests = read_batch_requests(text, label)
    try:
        return plan_requests(requests, model, label=label, priority=priority)
    except RequestError as exc:
        raise BatchFileError([LineError(exc.line, str(exc), exc.param)]) from None


def read_batch_requests(text: str, label: str, *,
                        endpoint: str = CHAT_ENDPOINT) -> list[PlannedRequest]:
    requests, errors, first_line_of = [], [], {}
    for number, raw in enumerate(split_lines(text), start=1):
        if len(errors) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        try:
            requests.append(_request(raw, number, label, endpoint, first_line_of))
        except RequestError as exc:
            errors.append(LineError(number, f"{label}:{number}: {exc}", exc.param))
    if not requests and not errors:
        errors.append(LineError(None, f"{label}: no requests found (one JSON object a line)"))
    if errors:
        raise BatchFileError(errors)
    return requests


def _request(raw: str, number: int, label: str, endpoint: str,
             first_line_of: dict[str, int]) -> PlannedRequest:
    try:
        obj = strict_json(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # NaN, an endless number, a lone surrogate
        raise RequestError(f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise RequestError(f"expected a JSON object with {', '.join(LINE_KEYS)}")
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise RequestError(f"unknown key {unknown[0]!r} (a line has {', '.join(LINE_KEYS)})",
                           unknown[0])
    missing = [k for k in LINE_KEYS if k not in obj]
    if missing:
        raise RequestError(f"missing {missing[0]!r}", missing[0])
    custom_id = obj["custom_id"]
    if not isinstance(custom_id, str) or not custom_id.strip() or len(custom_id) > MAX_CUSTOM_ID:
        raise RequestError(f"'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID} "
                           "characters", "custom_id")
    if custom_id in first_line_of:
        raise RequestError(f"duplicate custom_id {custom_id!r} (first at "
                           f"{label}:{first_line_of[custom_id]})", "custom_id")
    first_line_of[custom_id] = number
    if obj["method"] != "POST":
        raise RequestError(f"method must be 'POST', got {obj['method']!r}", "method")
    if obj["url"] != endpoint:
        raise RequestError(f"url must be {endpoint!r} (the batch's endpoint), got "
                           f"{obj['url']!r}", "url")
    try:
        return PlannedRequest(number, custom_id, parse_chat_body(obj["body"]))
    except RequestError as exc:
        raise RequestError(f"body: {exc}", f"body.{exc.param}" if exc.param else "body") from None


def ingest_batch_file(db, path, model: PromptModel, *, priority: int = 0, force: bool = False,
                      max_bytes: int | None = None):
    """`ppqa ingest --openai-batch`: read, plan and queue a batch file as a new batch (all or
    nothing). Returns (BatchRow, IngestResults, BatchPlan)."""
    from ppqa.files.inputs import read_text
    from ppqa.store.openai_batches import ingest_plan

    label = "<stdin>" if str(path) == "-" else str(path)
    text = (read_text(path, "batch file") if max_bytes is None
            else read_text(path, "batch file", max_bytes))
    plan = plan_batch_file(text, Path(label).name, model, priority=priority)
    batch, results = ingest_plan(db, plan, model=model.name, force=force)
    return batch, results, plan
