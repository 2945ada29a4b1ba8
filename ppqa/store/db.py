"""Opening the job store: where it lives, how SQLite is set up, and the two kinds of transaction.

`open_db(location)` turns a `--db` value (a file path or any SQLAlchemy URL; default: `ppqa.db`
in the user's data directory, or in `$PPQA_HOME`) into a `Database`, checks that it can be read
and applies pending migrations. Every failure to open, read or reach it becomes one
`DatabaseUnavailable` with a message naming the database.

SQLite runs in WAL mode (readers never wait for the writer) with foreign keys on and a busy
timeout. Python's sqlite3 driver is put in autocommit mode so that we emit BEGIN ourselves:
`Database.write()` opens `BEGIN IMMEDIATE`, taking the write lock up front, because a deferred
transaction that reads and then writes can fail at once with "database is locked" when another
process committed in between, which busy_timeout does not retry.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from ppqa.paths import ppqa_home
from ppqa.store.errors import DatabaseUnavailable

BUSY_TIMEOUT_MS = 30_000
DB_FILE_NAME = "ppqa.db"


def resolve_url(location: str | os.PathLike[str] | None) -> str:
    """A `--db` value as an SQLAlchemy URL: None means the default file, a path means SQLite."""
    if location is None or str(location) == "":
        return f"sqlite:///{(ppqa_home() / DB_FILE_NAME).resolve()}"
    location = str(location)
    if "://" in location:
        return location
    return f"sqlite:///{Path(location).expanduser().resolve()}"


def _describe(url: str) -> str:
    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    if parsed.get_backend_name() == "sqlite":
        return parsed.database or ":memory:"
    return parsed.render_as_string(hide_password=True)


def _enable_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the file to WAL (once per file; later connections find it set). While other
    processes open a new file at the same moment, SQLite can answer "database is locked" at
    once, without waiting on its busy handler (seen here: 1 failed open in 160, four processes
    opening blank files together), so retry with backoff for up to the busy timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.002
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.1)


def _setup_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see module doc)
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _enable_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get("ppqa_begin", "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")


@dataclass
class Database:
    """An open store: the engine plus the transaction helpers every store function uses."""

    engine: Engine
    url: str

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def description(self) -> str:
        return _describe(self.url)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction (a consistent snapshot; never blocks writers on SQLite)."""
        with self.engine.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A short write transaction; on SQLite it holds the write lock from its first statement."""
        with self.engine.connect() as conn:
            conn.execution_options(ppqa_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def now(self, conn: Connection) -> datetime:
        """Current naive-UTC time; on a server database the server's clock, shared by all hosts."""
        if self.dialect == "postgresql":
            return conn.execute(text("SELECT CAST(timezone('UTC', clock_timestamp()) AS timestamp)")
                                ).scalar_one()
        return datetime.now(timezone.utc).replace(tzinfo=None)

    def close(self) -> None:
        self.engine.dispose()


def open_db(location: str | os.PathLike[str] | None = None, *, migrate: bool = True) -> Database:
    """Open (creating if needed) and migrate the store at `location`; see the module doc."""
    url = resolve_url(location)
    where = _describe(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUnavailable(f"cannot open database {url!r}: not a file path or database URL")
    kwargs: dict = {}
    if parsed.get_backend_name() == "sqlite":
        path = Path(parsed.database or "")
        if parsed.database and path.is_dir():
            raise DatabaseUnavailable(f"cannot open database {where}: it is a directory")
        if parsed.database and not path.parent.is_dir():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseUnavailable(
                    f"cannot open database {where}: cannot create its folder ({exc.strerror})")
    elif parsed.get_backend_name() == "postgresql":
        # Fail fast on an unreachable server instead of hanging a command.
        kwargs["connect_args"] = {"connect_timeout": 5}
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ImportError, ArgumentError) as exc:
        raise DatabaseUnavailable(f"cannot open database {where}: {exc}")
    if engine.dialect.name == "sqlite":
        _setup_sqlite(engine)
    db = Database(engine=engine, url=url)
    try:
        if migrate:
            from ppqa.store.migrations import migrate as run_migrations

            run_migrations(db)
        else:
            with db.read() as conn:
                conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        engine.dispose()
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        raise DatabaseUnavailable(f"cannot open database {where}: {reason}")
    return db
