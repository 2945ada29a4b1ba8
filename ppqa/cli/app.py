"""The `ppqa` command: global options, error handling, and the list of command modules.

`main()` is the console script. The app's callback takes the global options (`--db`, also
PPQA_DB; `--version`) and leaves the store location in `ctx.obj` for `common.open_store`.
Each module in COMMAND_MODULES defines `app = typer.Typer()`; modules with a group name become a
sub-command group (`ppqa models list`), the others add their commands at the top level.
Importing this file must not import torch: modules import heavy libraries inside the commands
that need them.
"""

import importlib
import importlib.metadata
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from ppqa.cli.common import DbOption, fail
from ppqa.store.errors import InputError, OutputError, StoreError

# (module in ppqa.cli, group name or None for top-level commands): one line per module.
COMMAND_MODULES: list[tuple[str, str | None]] = [
    ("ingest", None),
    ("status", None),
    ("jobs", None),  # jobs, show
    ("run", None),
    ("export", None),
    ("report", None),
    ("control", None),  # cancel, retry
    ("models", "models"),
    ("bench", None),
    ("serve", None),
]


# Click's UsageError, whether Typer vendors Click (>= 0.2x) or uses it: the base of its public
# BadParameter.
UsageError = typer.BadParameter.__mro__[1]


class PpqaGroup(TyperGroup):
    """Turns expected failures of any command into one line and exit code 2 (see common.py):
    bad input, a refused request, an output that cannot be written, and a database that
    fails under a command (read-only, full, locked past its timeout, gone)."""

    def invoke(self, ctx: typer.Context):
        from sqlalchemy.exc import SQLAlchemyError

        try:
            return super().invoke(ctx)
        except (InputError, StoreError, OutputError) as exc:
            fail(str(exc))
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "ppqa"
            fail(f"{exc.format_message()} (see '{where} --help')")
        except SQLAlchemyError as exc:
            fail(database_failure(ctx, exc))


def database_failure(ctx: typer.Context, exc: Exception) -> str:
    """One line for a database error raised while a command ran."""
    from ppqa.store.db import error_reason

    db = (ctx.obj or {}).get("database")
    where = db.description if db is not None else "the database"
    reason = error_reason(exc)
    if "readonly" in reason.replace("-", "").replace(" ", ""):
        return (f"cannot write to database {where}: {reason} (check that you may write the "
                "file and its folder)")
    return f"database {where} failed: {reason}"


def _version() -> str:
    try:
        return importlib.metadata.version("ppqa")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        import ppqa

        return getattr(ppqa, "__version__", "unknown")


def _show_version(value: bool) -> None:
    if value:
        print(f"ppqa {_version()}")
        raise typer.Exit()


app = typer.Typer(
    cls=PpqaGroup, no_args_is_help=True, add_completion=False,
    # An unexpected error's traceback must not print local variables (a --db URL's password).
    pretty_exceptions_show_locals=False,
    help="ppqa: answer many questions about one long document with a local LLM, fast.\n\n"
         "Queue work with `ppqa ingest`, answer it with `ppqa run`, collect it with `ppqa export`.")


@app.callback()
def _global_options(
    ctx: typer.Context,
    db: DbOption = None,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                          help="Print ppqa's version and exit.")] = False,
) -> None:
    ctx.ensure_object(dict)["db_location"] = db


def _register() -> None:
    for module_name, group in COMMAND_MODULES:
        module = importlib.import_module(f"ppqa.cli.{module_name}")
        if group is None:
            app.add_typer(module.app)
        else:
            app.add_typer(module.app, name=group)


_register()


def main() -> None:
    try:
        app(prog_name="ppqa")
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: one line, no traceback
        print("ppqa: interrupted", file=sys.stderr)
        _exit(130)
    except SystemExit as exc:  # how click ends every command
        _exit(exc.code)


def _exit(code) -> None:
    """End the process with `code` (SystemExit's meaning: None is 0, a string is printed and
    means 1). Where torch is loaded (a worker, a server), the interpreter's own teardown of its
    modules and tensors takes most of a second after the command is done; with everything of
    ours closed by then, the process does what Python's exit does first (join the threads it
    would join, run the atexit handlers, flush) and then ends without the teardown."""
    if "torch" not in sys.modules:
        raise SystemExit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    import atexit
    import os
    import threading

    # Python's own first step: the threading exit hooks (which tell idle executor threads, such
    # as the grammar masks' pool, to end), then a join of every non-daemon thread. Joining
    # without the hooks waits forever on an idle executor's thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass
    os._exit(code)
