"""Writing export files: the store's export rows to CSV, JSONL or JSON, or to stdout.

A file is written atomically (a temporary file in the same folder, fsynced, then renamed over the
target). CSV files start with a UTF-8 byte order mark so that spreadsheet programs read them as
UTF-8; quoting follows RFC 4180, so commas, quotes and newlines inside answers survive.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO

from ppqa.store.errors import InputError
from ppqa.store.export import EXPORT_COLUMNS

EXPORT_FORMATS = ("csv", "jsonl", "json")
# The OpenAI Batch output format (ppqa.openai.batch_out), only by name: its files end in .jsonl.
OPENAI_BATCH_FORMAT = "openai-batch"


def export_format(dest: str, fmt: str | None) -> str:
    """The format to write: `fmt` if given, else from the file extension (stdout: csv)."""
    if fmt is not None:
        if fmt not in (*EXPORT_FORMATS, OPENAI_BATCH_FORMAT):
            raise InputError(f"unknown format {fmt!r}; choose one of "
                             f"{', '.join((*EXPORT_FORMATS, OPENAI_BATCH_FORMAT))}")
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
