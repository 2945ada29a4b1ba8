"""`ppqa status`: the queue at a glance, per document (from `ppqa.store.views.queue_status`)."""

import typer

from ppqa.cli.common import JsonOption, open_store, print_json, say
from ppqa.cli.render import console, status_table

app = typer.Typer()


@app.command(help="Show the queue at a glance: jobs by status and questions answered, per "
                  "document.\n\nExamples:\n\n  ppqa status\n\n  ppqa --db jobs.db status --json")
def status(ctx: typer.Context, json_out: JsonOption = False) -> None:
    from ppqa.store.views import queue_status

    data = queue_status(open_store(ctx))
    if json_out:
        print_json(data)
    elif not data["documents"]:
        say("the queue is empty; add work with: ppqa ingest DOCUMENT QUESTIONS")
    else:
        console().print(status_table(data))
