"""What every command shares: option aliases, opening the store, JSON output and errors.

Error policy (all commands, including those of other modules): bad input or a refused request
raises `InputError` / `StoreError`; the app's group (`PpqaGroup` in app.py) turns it into ONE
line "error: ..." on stderr and exit code 2, with the store unchanged. Data goes to stdout,
messages to stderr.
"""

import json
import sys
from typing import Annotated, Any, NoReturn

import typer

DbOption = Annotated[
    str | None,
    typer.Option("--db", envvar="PPQA_DB", show_default=False, metavar="PATH|URL",
                 help="The job store: a SQLite file path or any SQLAlchemy URL, e.g. --db jobs.db "
                      "or --db postgresql+psycopg://user@host/ppqa. Default: ppqa.db in the user "
                      "data folder ($PPQA_HOME overrides it)."),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print plain JSON on stdout instead of a table.")]
# Job ids and counts stay within a 32-bit INTEGER, what PostgreSQL stores (and far beyond any
# real queue), so an out-of-range number is a one-line usage error, not a driver overflow.
MAX_ID = 2**31 - 1
JobArg = Annotated[int, typer.Argument(min=1, max=MAX_ID,
                                       help="The job id, as printed by ppqa ingest.")]


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (bad input); passwords masked."""
    print(f"error: {' '.join(redacted(message).split())}", file=sys.stderr)
    raise typer.Exit(2)


def say(message: str) -> None:
    """A message for the person at the terminal (stderr, so stdout stays data)."""
    print(redacted(message), file=sys.stderr)


def redacted(message) -> str:
    """`message` without passwords (`ppqa.store.db.redact`), loading SQLAlchemy only if the
    store was used at all: a password can only be known once a store was opened."""
    if "ppqa.store.db" not in sys.modules:
        return str(message)
    from ppqa.store.db import redact

    return redact(message)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def open_store(ctx: typer.Context, *, create: bool = False):
    """The store named by the global --db option, opened once per invocation and closed with it.
    Other command modules (run, bench) use this too. `create`: a missing SQLite file may be
    created (ingest, run); other commands refuse it, so that a typo makes no new store."""
    from ppqa.store.db import open_db  # sqlalchemy loads only for commands that need it

    obj = ctx.ensure_object(dict)  # shared with the app callback, which set db_location
    if "database" not in obj:
        obj["database"] = open_db(obj.get("db_location"), create=create)
        ctx.find_root().call_on_close(obj["database"].close)
    return obj["database"]
