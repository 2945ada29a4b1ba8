"""Exporting answers: which rows (`export_rows`) and how they are written (`write_export`).

Rows come from the store, one per question of the selected jobs (finished jobs by default,
chosen jobs with `job_ids`, every job with `include_all`; a question not answered yet has an
empty answer). They go to a CSV, JSONL or JSON file written atomically (a temporary file in the
same folder, fsynced, then renamed over the target), or to stdout. CSV files start with a UTF-8
byte order mark so that spreadsheet programs read them as UTF-8; quoting follows RFC 4180, so
commas, quotes and newlines inside answers survive.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO

from sqlalchemy import select

from ppqa.store.db import Database
from ppqa.store.errors import InputError, StoreError
from ppqa.store.models import DONE, Answer, Document, Job, Question, Report
from ppqa.store.views import iso

EXPORT_COLUMNS = ("job", "document", "question_id", "question", "answer", "finish_reason",
                  "tokens", "model", "mode", "finished_at")
EXPORT_FORMATS = ("csv", "jsonl", "json")


def export_rows(db: Database, job_ids: list[int] | None = None, include_all: bool = False
                ) -> list[dict]:
    with db.read() as conn:
        stmt = select(Job.id, Job.params)
        if job_ids:
            found = set(conn.execute(select(Job.id).where(Job.id.in_(job_ids))).scalars())
            missing = [j for j in job_ids if j not in found]
            if missing:
                raise StoreError(f"no job {missing[0]}")
            stmt = stmt.where(Job.id.in_(job_ids))
        elif not include_all:
            stmt = stmt.where(Job.status == DONE)
        jobs = {row.id: row.params for row in conn.execute(stmt)}
        if not jobs:
            return []
        # The model and mode that actually ran: the job's latest report, else what it asked for.
        ran = {}
        for job_id, model, mode in conn.execute(
                select(Report.job_id, Report.model, Report.mode)
                .where(Report.job_id.in_(list(jobs))).order_by(Report.id)):
            ran[job_id] = (model, mode)
        rows = conn.execute(
            select(Question.job_id, Document.name, Question.custom_id, Question.text,
                   Answer.text.label("answer"), Answer.finish_reason, Answer.token_count,
                   Answer.created_at)
            .join(Job, Job.id == Question.job_id).join(Document, Document.id == Job.document_id)
            .outerjoin(Answer, Answer.question_id == Question.id)
            .where(Question.job_id.in_(list(jobs)))
            .order_by(Question.job_id, Question.position)).all()
    out = []
    for r in rows:
        params = jobs[r.job_id] or {}
        model, mode = ran.get(r.job_id, (params.get("model"), params.get("mode")))
        out.append({"job": r.job_id, "document": r.name, "question_id": r.custom_id,
                    "question": r.text, "answer": r.answer, "finish_reason": r.finish_reason,
                    "tokens": r.token_count, "model": model, "mode": mode,
                    "finished_at": iso(r.created_at)})
    return out


def export_format(dest: str, fmt: str | None) -> str:
    """The format to write: `fmt` if given, else from the file extension (stdout: csv)."""
    if fmt is not None:
        if fmt not in EXPORT_FORMATS:
            raise InputError(f"unknown format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
        return fmt
    if dest == "-":
        return "csv"
    suffix = Path(dest).suffix.lower().lstrip(".")
    if suffix not in EXPORT_FORMATS:
        raise InputError(f"{dest}: cannot tell the format from {('.' + suffix) if suffix else 'no extension'!r}; "
                         f"use a .csv, .jsonl or .json name or --format")
    return suffix


def check_destination(dest: str) -> None:
    """Refuse a target we could not write, before anything is read or written."""
    if dest == "-":
        return
    path = Path(dest)
    if path.is_dir():
        raise InputError(f"{dest}: is a directory")
    if not path.resolve().parent.is_dir():
        raise InputError(f"{dest}: folder {str(path.resolve().parent)!r} does not exist")


def _write(rows: list[dict], fmt: str, stream: IO[str]) -> None:
    if fmt == "csv":
        writer = csv.writer(stream)  # RFC 4180: CRLF line ends, quotes where needed
        writer.writerow(EXPORT_COLUMNS)
        for row in rows:
            writer.writerow(["" if row[c] is None else row[c] for c in EXPORT_COLUMNS])
    elif fmt == "jsonl":
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        json.dump(rows, stream, ensure_ascii=False, indent=2)
        stream.write("\n")


def write_export(rows: list[dict], dest: str, fmt: str) -> None:
    """Write `rows` to `dest` (`-`: stdout) in `fmt`; a file is replaced atomically."""
    if dest == "-":
        _write(rows, fmt, sys.stdout)
        sys.stdout.flush()
        return
    check_destination(dest)
    path = Path(dest).resolve()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8-sig" if fmt == "csv" else "utf-8",
                       newline="") as stream:
            _write(rows, fmt, stream)
            stream.flush()
            os.fsync(stream.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
