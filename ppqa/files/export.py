"""Writing export files: the store's export rows to CSV, JSONL or JSON, or to stdout.

A regular file (or a new one) is written atomically: a temporary file in the same folder,
fsynced, then renamed over the target, so a failure (a full disk) leaves the old file intact. A
file replaced keeps its permissions. Anything else (a FIFO, a device, a path under /dev or
/proc) is written through, appended to, never replaced; /dev/stdout is stdout itself, as `-`.
CSV files start with a UTF-8 byte order mark so that spreadsheet programs read them as UTF-8;
quoting follows RFC 4180, so commas, quotes and newlines inside answers survive, and a text cell
that a spreadsheet would run as a formula (it starts with =, +, -, @, a tab or a CR: an answer
can be steered by its document) gets a leading ' as OWASP advises. JSON and JSONL keep every
value exactly; the answers of a job with a JSON schema are written there as the JSON values they
are (in CSV, as their JSON text). When any row is a question with choices, the CSV gains the
store's CHOICE_COLUMNS, `choice_scores` as compact JSON text (one fixed set of columns whatever
the labels; the README says why); when any is a job of several samples, a `sample` column; when
any is a question with choices in such a job, its question's `vote` and `vote_share`
(store/export.py).
"""

from __future__ import annotations

import csv
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterable
from typing import IO

from ppqa.store.errors import InputError, OutputError
from ppqa.store.export import (CHOICE_COLUMNS, EXPORT_COLUMNS, SAMPLE_COLUMN, VOTE_COLUMNS,
                               JsonAnswer)

EXPORT_FORMATS = ("csv", "jsonl", "json")
# The OpenAI Batch output format (ppqa.openai.batch_out), only by name: its files end in .jsonl.
OPENAI_BATCH_FORMAT = "openai-batch"
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def export_format(dest: str, fmt: str | None) -> str:
    """The format to write: `fmt` if given, else from the file extension (stdout, or a pipe
    or device without one such as /dev/stdout: csv)."""
    if fmt is not None:
        if fmt not in (*EXPORT_FORMATS, OPENAI_BATCH_FORMAT):
            raise InputError(f"unknown format {fmt!r}; choose one of "
                             f"{', '.join((*EXPORT_FORMATS, OPENAI_BATCH_FORMAT))}")
        return fmt
    suffix = Path(dest).suffix.lower().lstrip(".")
    if dest == "-" or (not suffix and _writes_through(dest)):
        return "csv"
    if suffix not in EXPORT_FORMATS:
        raise InputError(f"{dest}: cannot tell the format from {('.' + suffix) if suffix else 'no extension'!r}; "
                         f"use a .csv, .jsonl or .json name or --format")
    return suffix


def check_destination(dest: str) -> None:
    """Refuse a target we could not write, before anything is read or written."""
    if dest == "-" or _writes_through(dest):
        return
    path = Path(dest)
    if path.is_dir():
        raise InputError(f"{dest}: is a directory")
    if not path.resolve().parent.is_dir():
        raise InputError(f"{dest}: folder {str(path.resolve().parent)!r} does not exist")


def _writes_through(dest: str) -> bool:
    """True for a target that must be opened and written, not replaced (see the module doc)."""
    if Path(dest).absolute().parts[1:2] in (("dev",), ("proc",)):
        return True
    try:
        mode = os.stat(dest).st_mode
    except OSError:
        return False  # a new file (or one we will fail to create, with its own message)
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def csv_cell(value) -> object:
    """A CSV cell: None empty, a would-be formula prefixed with ' (see the module doc)."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def csv_columns(rows: list[dict]) -> tuple[str, ...]:
    """The columns a CSV of `rows` needs (store/export.py's `_columns` gives the same from the
    store before the rows are read)."""
    columns = EXPORT_COLUMNS
    if any("choice_scores" in row for row in rows):
        columns += CHOICE_COLUMNS
    if any(SAMPLE_COLUMN in row for row in rows):
        columns += (SAMPLE_COLUMN,)
    if any(VOTE_COLUMNS[0] in row for row in rows):
        columns += VOTE_COLUMNS
    return columns


def _write(rows: Iterable[dict], fmt: str, stream: IO[str],
           columns: tuple[str, ...] | None = None) -> None:
    """Rows as they come (a CSV without `columns` reads them all first to find its columns);
    the JSON array is written a row at a time, as json.dump with indent=2 would write it."""
    if fmt == "csv":
        writer = csv.writer(stream)  # RFC 4180: CRLF line ends, quotes where needed
        if columns is None:
            rows = list(rows)
            columns = csv_columns(rows)
        optional = (*CHOICE_COLUMNS, SAMPLE_COLUMN, *VOTE_COLUMNS)
        writer.writerow(columns)
        for row in rows:
            # A mixed export: rows of questions without choices (or samples) lack those fields.
            writer.writerow([csv_cell(_flat(row.get(c) if c in optional else row[c]))
                             for c in columns])
    elif fmt == "jsonl":
        for row in rows:
            stream.write(json.dumps(_parsed(row), ensure_ascii=False) + "\n")
    else:
        opening = "[\n  "
        for row in rows:
            stream.write(opening + json.dumps(_parsed(row), ensure_ascii=False, indent=2)
                         .replace("\n", "\n  "))
            opening = ",\n  "
        stream.write("[]\n" if opening.startswith("[") else "\n]\n")


def _parsed(row: dict) -> dict:
    """The row with a JSON answer as the value it parses to; an answer that does not parse
    (cut short by the token budget, finish_reason "length") stays its text."""
    answer = row.get("answer")
    if not isinstance(answer, JsonAnswer):
        return row
    try:
        return {**row, "answer": json.loads(answer)}
    except ValueError:
        return {**row, "answer": str(answer)}
def _flat(value) -> object:
    """A CSV cell's value: lists (a question's choice scores) as compact JSON text."""
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return value


def _encoding(fmt: str) -> str:
    return "utf-8-sig" if fmt == "csv" else "utf-8"


_STDOUT_NAMES = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def write_export(rows: Iterable[dict], dest: str, fmt: str,
                 columns: tuple[str, ...] | None = None) -> None:
    """Write `rows` to `dest` (`-`: stdout) in `fmt`, atomically or through (module doc), as
    they come; `columns`: a CSV's, known before its rows (else found from them all).
    OutputError with one line when it cannot be written."""
    if dest in _STDOUT_NAMES:  # our own stdout, not a reopening (which has its own offset)
        dest = "-"
    if dest == "-":
        try:
            _write(rows, fmt, sys.stdout, columns)
            sys.stdout.flush()
        except BrokenPipeError:
            # Whatever is still buffered cannot go anywhere; keep the interpreter's final
            # flush from raising again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise OutputError("stdout was closed before the export was written") from None
        return
    check_destination(dest)
    through = _writes_through(dest)
    try:
        if through:
            # Appending: a path that reopens a redirected stream must not truncate it.
            with open(dest, "a", encoding=_encoding(fmt), newline="") as stream:
                _write(rows, fmt, stream, columns)
        else:
            _replace(rows, Path(dest).resolve(), fmt, columns)
    except OSError as exc:
        kept = " (the file there is unchanged)" if not through and Path(dest).exists() else ""
        raise OutputError(f"{dest}: cannot write it ({exc.strerror or exc}){kept}") from None


def _replace(rows: Iterable[dict], path: Path, fmt: str, columns: tuple[str, ...] | None
             ) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding=_encoding(fmt), newline="") as stream:
            _write(rows, fmt, stream, columns)
            stream.flush()
            os.fsync(stream.fileno())
        if path.exists():  # a file replaced keeps its permissions
            mode = stat.S_IMODE(path.stat().st_mode)
        else:  # mkstemp makes 0600; a new file gets the usual mode
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
