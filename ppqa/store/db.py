"""Opening the job store: where it lives, how SQLite is set up, and the two kinds of transaction.

`open_db(location)` turns a `--db` value (a file path or any SQLAlchemy URL; default: `ppqa.db`
in the user's data directory, or in `$PPQA_HOME`) into a `Database`, checks that it can be read
and applies pending migrations. Every failure to open, read or reach it becomes one
`DatabaseUnavailable` with a message naming the database. It refuses what is not a ppqa store
before changing anything: a database holding another program's tables (ppqa would add its own
and switch the file to WAL), an in-memory SQLite database (an ingest into it would be lost at
exit) and, unless `create`, a SQLite file that does not exist (a typo must not create one).

No message shows a password: `redact` masks the passwords of every location `open_db` was
given, and anything written like one, in whatever text it is handed.

SQLite runs in WAL mode (readers never wait for the writer) with foreign keys on and a busy
timeout. Python's sqlite3 driver is put in autocommit mode so that we emit BEGIN ourselves:
`Database.write()` opens `BEGIN IMMEDIATE`, taking the write lock up front, because a deferred
transaction that reads and then writes can fail at once with "database is locked" when another
process committed in between, which busy_timeout does not retry.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
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


# Passwords of the locations opened in this process, masked wherever they appear (a driver may
# quote a URL it could not parse in its own words).
_SECRETS: set[str] = set()
_URL_PASSWORD = re.compile(r"(://[^:/?#@\s]*:)[^/?#\s]*@")  # scheme://user:PASSWORD@host
# password=SECRET in a query string or a libpq DSN; a trailing ':' or ',' is the message's own.
_KEY_PASSWORD = re.compile(
    r"(password\s*=\s*)(?!\*\*\*)('[^']*'|\"[^\"]*\"|[^&\s'\"]+?(?=[:,;]?(?:\s|&|$)))",
    re.IGNORECASE)


def remember_secrets(location: str) -> None:
    """Note the password(s) in a database location, as written and as parsed."""
    location = str(location)
    for pattern in (_URL_PASSWORD, _KEY_PASSWORD):
        for match in pattern.finditer(location):
            secret = match.group(0)[len(match.group(1)):].rstrip("@").strip("'\"")
            _remember(secret)
    try:
        password = make_url(location).password
    except (ArgumentError, ValueError, TypeError):
        return
    _remember(str(password or ""))


def _remember(secret: str) -> None:
    # A one- or two-character password would mask every such letter pair in a message; the
    # patterns of `redact` still hide it where a URL or a DSN shows it.
    if len(secret) >= 3:
        _SECRETS.add(secret)


def redact(text: str) -> str:
    """`text` with every known password, and anything shaped like one, replaced by ***."""
    text = str(text)
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(lambda m: m.group(1) + "***@", text)
    return _KEY_PASSWORD.sub(lambda m: m.group(1) + "***", text)


def _describe(url: str) -> str:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return redact(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.database or ":memory:"
    return redact(parsed.render_as_string(hide_password=True))


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


def open_db(location: str | os.PathLike[str] | None = None, *, migrate: bool = True,
            create: bool = True) -> Database:
    """Open (creating if needed and `create`) and migrate the store at `location`; see the
    module doc. The default location may always be created."""
    url = resolve_url(location)
    remember_secrets(url)
    where = _describe(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        hint = " (it holds a space)" if " " in url else ""
        raise DatabaseUnavailable(f"cannot open database {where}: not a file path or database "
                                  f"URL{hint}")
    if re.search(r"://[^/]*@[^/]*@", url):  # the driver would read part of the password as host
        raise DatabaseUnavailable(f"cannot open database {where}: the URL holds two '@'; write "
                                  "an '@' inside the user name or password as %40")
    kwargs: dict = {}
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite_file(parsed, where, create or location in (None, ""))
    elif parsed.get_backend_name() == "postgresql":
        # Fail fast on an unreachable server instead of hanging a command.
        kwargs["connect_args"] = {"connect_timeout": 5}
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ImportError, ArgumentError, ValueError, TypeError) as exc:
        raise DatabaseUnavailable(f"cannot open database {where}: {redact(exc)}")
    if engine.dialect.name == "sqlite":
        _setup_sqlite(engine)
    db = Database(engine=engine, url=url)
    try:
        if engine.dialect.name != "sqlite":  # SQLite files are checked before connecting
            with db.read() as conn:
                _check_tables(inspect(conn).get_table_names(), where)
        if migrate:
            from ppqa.store.migrations import migrate as run_migrations

            run_migrations(db)
        else:
            with db.read() as conn:
                conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        engine.dispose()
        raise DatabaseUnavailable(f"cannot open database {where}: {error_reason(exc)}")
    except DatabaseUnavailable:
        engine.dispose()
        raise
    return db


def error_reason(exc: Exception) -> str:
    """The first line of a database error, as the driver gave it, without passwords."""
    orig = getattr(exc, "orig", None)
    lines = str(orig if orig is not None else exc).strip().splitlines()
    return redact(lines[0] if lines else type(exc).__name__)


def _check_sqlite_file(parsed, where: str, create: bool) -> None:
    """Refuse an in-memory database, a missing file (unless `create`) and a file of another
    program, looking at it read-only so that nothing in it changes."""
    database = parsed.database or ""
    if database in ("", ":memory:") or "memory" in str(parsed.query.get("mode", "")) \
            or database.startswith("file::memory:"):
        raise DatabaseUnavailable(
            "cannot use an in-memory SQLite database: what is written to it is lost when the "
            "command exits; give a file path, e.g. --db jobs.db")
    if parsed.query.get("uri") and database.startswith("file:"):
        database = database[len("file:"):].split("?", 1)[0]
    path = Path(database)
    if path.is_dir():
        raise DatabaseUnavailable(f"cannot open database {where}: it is a directory")
    if not path.exists():
        if not create:
            raise DatabaseUnavailable(f"cannot open database {where}: there is no store there "
                                      "(check the path; `ppqa ingest` creates a new one)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseUnavailable(
                f"cannot open database {where}: cannot create its folder ({exc.strerror})")
        return
    try:
        with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        conn.close()
    except sqlite3.Error as exc:
        raise DatabaseUnavailable(f"cannot open database {where}: {exc}")
    _check_tables(tables, where)


def _check_tables(tables: list[str], where: str) -> None:
    from ppqa.store.models import MigrationRecord

    foreign = [t for t in tables if not t.startswith("sqlite_")]
    if foreign and MigrationRecord.__tablename__ not in foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise DatabaseUnavailable(
            f"{where} is not a ppqa store: it holds another program's tables ({shown}), and "
            "ppqa will not add its own; give another --db (a new file, or an empty database)")
