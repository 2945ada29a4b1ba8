"""Reading a batch file (`ppqa ingest --batch`): one JSON object a line, each a document (inline
or a path relative to the batch file) with its questions and per-line option overrides.

Lines are checked with the same rules as single files (ppqa/files/inputs.py: UTF-8, the size
limit, strict JSON, questions and choices) before the store is opened; every problem raises
`InputError` naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppqa.files.inputs import (
    MAX_INPUT_BYTES, QuestionInput, check_questions, json_lines, question_from_obj, read_document,
    read_text, size_text, with_choices,
)
from ppqa.store.errors import InputError


PARAM_KEYS = ("template", "max_new_tokens", "temperature", "top_p", "seed", "mode", "model",
              "priority", "choice_norm", "samples",
              "json_schema")  # a JSON schema object: the answers are JSON that follows it


@dataclass
class BatchItem:
    """One line of a batch file: a document, its questions and per-line option overrides."""

    document_text: str
    name: str
    questions: list[QuestionInput]
    overrides: dict
    where: str


def read_batch(path: str | Path, max_bytes: int = MAX_INPUT_BYTES) -> list[BatchItem]:
    """Parse a batch `.jsonl`: one `{"document"|"document_path", "questions", ...}` a line.

    `document_path` is relative to the batch file's folder; `name` defaults to `id`, then to the
    document file's name; any of PARAM_KEYS overrides the command-line option for that line;
    `choices` (a list of labels) goes to every question of the line that has none of its own.
    """
    text = read_text(path, "batch file", max_bytes)
    label = "<stdin>" if str(path) == "-" else str(path)
    base = Path.cwd() if str(path) == "-" else Path(path).resolve().parent
    allowed = {"document", "document_path", "questions", "name", "id", "choices", *PARAM_KEYS}
    items = []
    for where, obj in json_lines(text, label):
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object with 'document' and 'questions'")
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise InputError(f"{where}: unknown key {unknown[0]!r} "
                             f"(allowed: {', '.join(sorted(allowed))})")
        if ("document" in obj) == ("document_path" in obj):
            raise InputError(f"{where}: give exactly one of 'document' and 'document_path'")
        if "document" in obj:
            doc = obj["document"]
            if not isinstance(doc, str) or not doc.strip():
                raise InputError(f"{where}: 'document' must be a non-empty string")
            if len(doc.encode("utf-8")) > max_bytes:
                raise InputError(f"{where}: the document is longer than the limit of "
                                 f"{size_text(max_bytes)} (raise it with --max-input-mb)")
            default_name = f"{Path(label).stem}-{where.rsplit(':', 1)[1]}"
        else:
            if not isinstance(obj["document_path"], str) or not obj["document_path"].strip():
                raise InputError(f"{where}: 'document_path' must be a non-empty string (a path "
                                 f"relative to the batch file), got {obj['document_path']!r}")
            doc_path = base / obj["document_path"]
            try:
                doc, default_name = read_document(doc_path, max_bytes)
            except InputError as exc:
                raise InputError(f"{where}: {exc}")
        raw_questions = obj.get("questions")
        if not isinstance(raw_questions, list):
            raise InputError(f"{where}: 'questions' must be a list of strings or objects")
        questions = [question_from_obj(q, i, f"{where} question {i + 1}")
                     for i, q in enumerate(raw_questions)]
        if "choices" in obj:
            shared = obj["choices"]
            if not isinstance(shared, list) or not all(isinstance(c, str) for c in shared):
                raise InputError(f"{where}: 'choices' must be a list of strings")
            questions = with_choices(questions, tuple(c.strip() for c in shared))
        check_questions(questions, where)
        name = obj.get("name") or obj.get("id") or default_name
        overrides = {k: obj[k] for k in PARAM_KEYS if k in obj}
        items.append(BatchItem(doc, str(name), questions, overrides, where))
    if not items:
        raise InputError(f"{label}: no documents found")
    return items
