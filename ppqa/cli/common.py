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


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (bad input)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(2)


def say(message: str) -> None:
    """A message for the person at the terminal (stderr, so stdout stays data)."""
    print(message, file=sys.stderr)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def open_store(ctx: typer.Context):
    """The store named by the global --db option, opened once per invocation and closed with it.
    Other command modules (run, bench) use this too."""
    from ppqa.store.db import open_db  # sqlalchemy loads only for commands that need it

    obj = ctx.ensure_object(dict)  # shared with the app callback, which set db_location
    if "database" not in obj:
        obj["database"] = open_db(obj.get("db_location"))
        ctx.find_root().call_on_close(obj["database"].close)
    return obj["database"]
