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
from typing import Annotated

import typer
from typer.core import TyperGroup

from ppqa.cli.common import DbOption, fail
from ppqa.store.errors import InputError, StoreError

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
    """Turns expected failures of any command into one line and exit code 2 (see common.py)."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (InputError, StoreError) as exc:
            fail(str(exc))
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "ppqa"
            fail(f"{exc.format_message()} (see '{where} --help')")


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
    app(prog_name="ppqa")
