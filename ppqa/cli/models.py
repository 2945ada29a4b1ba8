"""`ppqa models`: fetch the embedded model and show what can be loaded.

A thin layer over `engine/loading/model_cache.py`: `pull NAME` fetches an embedded model into
`$PPQA_HOME/models`; `list` shows embedded models (cached or not, with their path), the `dummy:`
presets and any .gguf files or Hugging Face directories in the cache, as a table on stdout or as
JSON with `--json`. Imports no torch at module import time (the model cache and presets are
imported inside the commands), so `ppqa --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Annotated

import typer

app = typer.Typer(help="Fetch and list models.", no_args_is_help=True)


@app.command("pull")
def pull(
    name: Annotated[str, typer.Argument(help="Embedded model to fetch, e.g. smollm2.")],
    force: Annotated[bool, typer.Option("--force", help="Fetch again even if cached.")] = False,
) -> None:
    """Fetch an embedded model into the model cache (checks its sha256)."""
    from ppqa.engine.loading import model_cache
    from ppqa.engine.loading.loader import ModelLoadError

    if name not in model_cache.EMBEDDED:
        typer.echo(f"error: unknown embedded model {name!r}; embedded models: "
                   f"{', '.join(model_cache.EMBEDDED)}", err=True)
        raise typer.Exit(2)
    try:
        path = model_cache.pull(name, force=force, progress=lambda msg: typer.echo(msg, err=True))
    except ModelLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(str(path))


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show embedded models, dummy presets and the models in the cache."""
    from ppqa.engine.loading import model_cache

    rows = model_cache.list_models()
    if as_json:
        typer.echo(json.dumps({"models_dir": str(model_cache.models_dir()),
                               "models": [asdict(r) for r in rows]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models (cache: {model_cache.models_dir()})")
    for column in ("name", "kind", "status"):
        table.add_column(column, no_wrap=True)
    table.add_column("path / description", overflow="fold")  # paths are data: never cut them
    for r in rows:
        status = "cached" if r.cached else "not cached"
        if r.kind == "dummy":
            status = "built in"
        table.add_row(r.name, r.kind, status, r.path or r.description)
    Console(file=sys.stdout, width=max(100, Console().width)).print(table)
