"""Files of the OpenAI Files API (`ppqa serve`'s /v1/files): uploads and batches' output files.

Their bytes are stored in the `openai_files` table, so a file id is all a client ever names: the
server reads and writes no path on a client's behalf. Ids are random ("file-" + 24 hex digits);
lists are newest first by default, paged with `after` (an id) and `limit`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, delete, insert, select

from ppqa.store.db import Database
from ppqa.store.errors import NotFoundError
from ppqa.store.models import OpenAIFile


def new_public_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class FileInfo:
    public_id: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime


_INFO = (OpenAIFile.public_id, OpenAIFile.filename, OpenAIFile.purpose, OpenAIFile.bytes,
         OpenAIFile.created_at)


def insert_file(conn: Connection, now: datetime, filename: str, purpose: str,
                content: bytes) -> FileInfo:
    """Store a file inside the caller's transaction."""
    info = FileInfo(new_public_id("file-"), filename, purpose, len(content), now)
    conn.execute(insert(OpenAIFile).values(
        public_id=info.public_id, filename=filename, purpose=purpose, bytes=len(content),
        content=content, created_at=now))
    return info


def create_file(db: Database, filename: str, purpose: str, content: bytes) -> FileInfo:
    with db.write() as conn:
        return insert_file(conn, db.now(conn), filename, purpose, content)


def get_file(db: Database, public_id: str) -> FileInfo:
    with db.read() as conn:
        row = conn.execute(select(*_INFO).where(OpenAIFile.public_id == public_id)).first()
    if row is None:
        raise NotFoundError(f"no file {public_id!r}")
    return FileInfo(*row)


def file_content(db: Database, public_id: str) -> tuple[FileInfo, bytes]:
    with db.read() as conn:
        row = conn.execute(select(*_INFO, OpenAIFile.content)
                           .where(OpenAIFile.public_id == public_id)).first()
    if row is None:
        raise NotFoundError(f"no file {public_id!r}")
    return FileInfo(*row[:5]), bytes(row[5])


def list_files(db: Database, *, purpose: str | None = None, limit: int = 20,
               after: str | None = None, newest_first: bool = True) -> tuple[list[FileInfo], bool]:
    """(files, has_more): up to `limit` files after the one with id `after`."""
    order = OpenAIFile.id.desc() if newest_first else OpenAIFile.id.asc()
    stmt = select(*_INFO).order_by(order).limit(limit + 1)
    if purpose is not None:
        stmt = stmt.where(OpenAIFile.purpose == purpose)
    with db.read() as conn:
        if after is not None:
            pk = conn.execute(select(OpenAIFile.id).where(OpenAIFile.public_id == after)
                              ).scalar_one_or_none()
            if pk is None:
                raise NotFoundError(f"no file {after!r}")
            stmt = stmt.where(OpenAIFile.id < pk if newest_first else OpenAIFile.id > pk)
        rows = [FileInfo(*r) for r in conn.execute(stmt)]
    return rows[:limit], len(rows) > limit


def delete_file(db: Database, public_id: str) -> None:
    with db.write() as conn:
        if conn.execute(delete(OpenAIFile).where(OpenAIFile.public_id == public_id)).rowcount == 0:
            raise NotFoundError(f"no file {public_id!r}")
