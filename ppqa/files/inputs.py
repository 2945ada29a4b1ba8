"""Reading what users ingest: a document file, a questions file, a template path, a JSON schema
(a batch file: ppqa/files/batch_file.py, from the same pieces).

Every check happens here, before the store is opened, so that bad input changes nothing. Each
problem raises `InputError` with one line naming the file and, where there is one, the line
(`questions.jsonl:4: invalid JSON ...`). Text files must be UTF-8 without NUL bytes; `-` reads
standard input. No file is read past `max_bytes` (16 MiB unless the caller says otherwise), so
an endless stream or a huge file is refused instead of filling memory. Lines end at LF, CRLF or
CR only (not at the other separators `str.splitlines` knows, which may sit inside a question or
a JSON string). Questions come from `.txt` (one a line; blank lines and `#` comments skipped),
`.jsonl` (`{"question": ..., "id": ..., "choices": [...]}`) or `.csv` (a `question` column,
optional `id` and `choices`, the labels separated by `|`); a question without an id gets its
1-based number as id. A question's choices (ppqa/choices.py) make it answered by choosing one.
A JSON schema file (`--json-schema`) is one JSON object that the grammar library must compile
(ppqa/json_schema.py).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ppqa.choices import check_choices
from ppqa.store.errors import InputError
from ppqa.templates import check_template, list_templates

QUESTION_FORMATS = (".txt", ".jsonl", ".csv")
MAX_INPUT_BYTES = 16 * 2**20  # per file; `ppqa ingest --max-input-mb` changes it
_LINE_END = re.compile(r"\r\n|\r|\n")
MAX_QUESTION_ID = 200  # questions.custom_id is a VARCHAR(200) (store/models.py)


@dataclass(frozen=True)
class QuestionInput:
    custom_id: str
    text: str
    where: str  # "file:line", for messages
    choices: tuple[str, ...] | None = None  # labels to choose from; None: a generated answer

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise InputError(f"{self.where}: empty question")
        if not self.custom_id.strip():
            raise InputError(f"{self.where}: empty question id")
        if self.choices is not None:
            try:
                object.__setattr__(self, "choices", check_choices(self.choices))
            except ValueError as exc:
                raise InputError(f"{self.where}: {exc}") from None
        if len(self.custom_id) > MAX_QUESTION_ID:
            raise InputError(f"{self.where}: the question id is {len(self.custom_id)} characters "
                             f"long; the store takes up to {MAX_QUESTION_ID}")
        for what, value in (("question", self.text), ("question id", self.custom_id),
                            *(("choice", c) for c in self.choices or ())):
            if "\x00" in value:
                raise InputError(f"{self.where}: the {what} contains a NUL character (\\u0000), "
                                 "which the store cannot hold")


def parse_choices(text: str, sep: str, where: str) -> tuple[str, ...]:
    """Labels from one string (`--choices "yes,no"`, a CSV cell "yes|no"), each stripped;
    InputError naming `where` unless they are at least two distinct non-empty labels."""
    try:
        return check_choices([c.strip() for c in text.split(sep)])
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None


def read_text(path: str | Path, what: str = "file", max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of `path` (`-`: stdin), refusing missing files, folders, binary data and
    anything longer than `max_bytes`."""
    label = "<stdin>" if str(path) == "-" else str(path)
    if str(path) == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
    else:
        p = Path(path)
        if p.is_dir():
            raise InputError(f"{label}: is a directory, not a {what}")
        if not p.exists():
            raise InputError(f"{label}: no such {what}")
        try:
            with p.open("rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise InputError(f"{label}: cannot read it ({exc.strerror})")
    if len(data) > max_bytes:
        raise InputError(f"{label}: the {what} is longer than the limit of {size_text(max_bytes)} "
                         "(raise it with --max-input-mb)")
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise InputError(f"{label}:{line}: binary data (NUL byte at offset {nul}), expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{label}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} "
                         f"at offset {exc.start})")
    return text.removeprefix("\ufeff")  # a BOM is an encoding mark, not content


def size_text(n: int) -> str:
    """A byte count as users read it: MiB from one MiB up."""
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n:,} bytes"


def split_lines(text: str) -> list[str]:
    """The lines of `text`, ended by LF, CRLF or CR only (see the module doc)."""
    lines = _LINE_END.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def read_document(path: str | Path, max_bytes: int = MAX_INPUT_BYTES) -> tuple[str, str]:
    """(text, default name) of a document file; an empty or blank document is refused."""
    text = read_text(path, "document", max_bytes)
    label = "<stdin>" if str(path) == "-" else str(path)
    if not text.strip():
        raise InputError(f"{label}: the document is empty" if not text
                         else f"{label}: the document is only whitespace")
    name = "stdin" if str(path) == "-" else Path(path).stem
    return text, name


def read_questions(path: str | Path, max_bytes: int = MAX_INPUT_BYTES) -> list[QuestionInput]:
    suffix = Path(str(path)).suffix.lower()
    if str(path) == "-":  # refused before stdin is read: the format comes from the extension
        raise InputError(f"questions cannot come from stdin ('-'): their format is the file's "
                         f"extension ({', '.join(QUESTION_FORMATS)}); give a file")
    text = read_text(path, "questions file", max_bytes)  # a missing file or a folder first
    if suffix not in QUESTION_FORMATS:
        raise InputError(f"{path}: unknown questions format {suffix or '(no extension)'!r}; "
                         f"use {', '.join(QUESTION_FORMATS)}")
    parse = {".txt": _parse_txt, ".jsonl": _parse_jsonl, ".csv": _parse_csv}[suffix]
    questions = parse(text, str(path))
    return check_questions(questions, str(path))


def check_questions(questions: list[QuestionInput], where: str) -> list[QuestionInput]:
    if not questions:
        raise InputError(f"{where}: no questions found")
    first_seen: dict[str, str] = {}
    for q in questions:
        if q.custom_id in first_seen:
            raise InputError(f"{q.where}: duplicate question id {q.custom_id!r} "
                             f"(first at {first_seen[q.custom_id]})")
        first_seen[q.custom_id] = q.where
    return questions


def _parse_txt(text: str, label: str) -> list[QuestionInput]:
    out = []
    for lineno, line in enumerate(split_lines(text), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(QuestionInput(str(len(out) + 1), line, f"{label}:{lineno}"))
    return out


def with_choices(questions: list[QuestionInput], choices: tuple[str, ...]) -> list[QuestionInput]:
    """The questions, each without choices of its own given `choices` (checked per question)."""
    return [q if q.choices is not None else
            QuestionInput(q.custom_id, q.text, q.where, choices) for q in questions]


def json_lines(text: str, label: str):
    """(where, value) for each non-blank line of a JSONL text; bad JSON names its line.
    Strict JSON: Python's NaN and Infinity, numbers too large for a float and strings holding
    lone surrogates (which no UTF-8 store can keep) are refused."""
    for lineno, line in enumerate(split_lines(text), start=1):
        if not line.strip():
            continue
        yield f"{label}:{lineno}", _parse_json(line, label, lineno)


def strict_json(line: str):
    """`json.loads`, refusing what is not JSON or not text (see `json_lines`): ValueError."""
    value = json.loads(line, parse_constant=_not_json, parse_float=_finite_float)
    _check_strings(value)
    return value


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def _check_strings(value) -> None:
    """Refuse strings (keys too) that are not valid Unicode text: JSON's \\ud800 escapes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate \\u escape, which is not "
                             "text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)


def _parse_jsonl(text: str, label: str) -> list[QuestionInput]:
    out: list[QuestionInput] = []
    for where, obj in json_lines(text, label):
        out.append(question_from_obj(obj, len(out), where))
    return out


def question_from_obj(obj: object, position: int, where: str) -> QuestionInput:
    """A question from a JSON value: a string, or {"question": ..., "id": ...}."""
    if isinstance(obj, str):
        return QuestionInput(str(position + 1), obj.strip(), where)
    if not isinstance(obj, dict):
        raise InputError(f'{where}: expected an object like {{"question": "...", "id": "..."}}')
    unknown = set(obj) - {"question", "id", "choices"}
    if unknown:
        raise InputError(f"{where}: unknown key {sorted(unknown)[0]!r} "
                         "(expected question, id, choices)")
    choices = obj.get("choices")
    if choices is not None and (not isinstance(choices, list)
                                or not all(isinstance(c, str) for c in choices)):
        raise InputError(f"{where}: 'choices' must be a list of strings")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{where}: 'question' must be a non-empty string")
    qid = obj.get("id", position + 1)
    if isinstance(qid, bool) or not isinstance(qid, (str, int)):
        raise InputError(f"{where}: 'id' must be a string or a whole number, got {qid!r}")
    return QuestionInput(str(qid).strip(), question.strip(), where,
                         None if choices is None else tuple(c.strip() for c in choices))


def _parse_csv(text: str, label: str) -> list[QuestionInput]:
    # strict: a quote opened and never closed is an error, not a field running to the end.
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise InputError(f"{label}: empty CSV file, expected a header with a 'question' column")
    except csv.Error as exc:
        raise InputError(f"{label}:1: malformed CSV ({exc})")
    columns = [h.strip().lower() for h in header]
    if "question" not in columns:
        shown = ", ".join(repr(h) for h in header) or "none"
        raise InputError(f"{label}:1: no 'question' column in the header (columns: {shown})")
    q_col = columns.index("question")
    id_col = columns.index("id") if "id" in columns else None
    choices_col = columns.index("choices") if "choices" in columns else None
    out = []
    start = reader.line_num + 1  # the line the next record starts on
    try:
        for row in reader:
            where = f"{label}:{start}"
            start = reader.line_num + 1
            if not any(cell.strip() for cell in row):
                continue
            question = row[q_col].strip() if q_col < len(row) else ""
            if not question:
                raise InputError(f"{where}: empty question")
            qid = row[id_col].strip() if id_col is not None and id_col < len(row) else ""
            cell = (row[choices_col].strip()
                    if choices_col is not None and choices_col < len(row) else "")
            choices = parse_choices(cell, "|", where) if cell else None
            out.append(QuestionInput(qid or str(len(out) + 1), question, where, choices))
    except csv.Error as exc:
        if reader.line_num > start and "end of data" in str(exc):
            raise InputError(f"{label}:{start}: malformed CSV (a quoted field opened on line "
                             f"{start} is never closed)")
        raise InputError(f"{label}:{reader.line_num}: malformed CSV ({exc})")
    return out


def resolve_template(template: str) -> str:
    """A built-in name as is, or a user `.jinja` file as an absolute path; else InputError."""
    if template in list_templates():
        return template
    path = Path(template).expanduser()
    if template.endswith(".jinja"):
        if path.is_file():
            return str(path.resolve())
        why = "is not a file" if path.exists() else "does not exist"
        raise InputError(f"template file {template!r} {why}")
    known = ", ".join(list_templates())
    raise InputError(f"unknown template {template!r} (built-in: {known}; or a path to a .jinja file)")


def read_template(template: str, max_bytes: int = MAX_INPUT_BYTES) -> tuple[str, str | None]:
    """(label, source) of a template: a built-in name with source None (the worker has it), or
    a user's `.jinja` file as (absolute path, its text), checked to compile, to define both
    blocks and to render a sample. The text is what the job keeps (see `store.jobs.ingest`)."""
    label = resolve_template(template)
    if label in list_templates():
        return label, None
    source = read_text(label, "template", max_bytes)
    try:
        check_template(source, label)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return label, source


def read_json_schema(path: str | Path, max_bytes: int = MAX_INPUT_BYTES) -> dict:
    """A JSON schema file (`ppqa ingest --json-schema`): one JSON object that the grammar
    library compiles (ppqa/json_schema.py); else InputError naming the file."""
    from ppqa.json_schema import check_json_schema

    label = "<stdin>" if str(path) == "-" else str(path)
    text = read_text(path, "JSON schema", max_bytes)
    schema = _parse_json(text, label)
    try:
        check_json_schema(schema)
    except ValueError as exc:
        raise InputError(f"{label}: {exc}") from None
    return schema


def _parse_json(text: str, label: str, lineno: int | None = None):
    """strict_json(text), or InputError naming `label` and the line: `lineno` when the text is
    one line of a file, else the line the parser stopped at."""
    try:
        return strict_json(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{label}:{lineno or exc.lineno}: invalid JSON "
                         f"({exc.msg} at column {exc.colno})")
    except ValueError as exc:
        raise InputError(f"{label}{f':{lineno}' if lineno else ''}: invalid JSON ({exc})")
