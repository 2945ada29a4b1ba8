"""`ppqa export FILE`: answers to CSV, JSONL or JSON through `ppqa.files.export` (a regular file
atomically, a FIFO or device written through)."""

from typing import Annotated

import typer

from ppqa.cli.common import MAX_ID, open_store, say
from ppqa.store.errors import InputError

app = typer.Typer()


@app.command(help="Export answers, one row per question: job, document, question_id, "
                  "question, answer, finish_reason, tokens, model, mode, finished_at. By "
                  "default the questions of finished (done) jobs.\n\nExamples:\n\n"
                  "  ppqa export answers.csv\n\n  ppqa export - --format jsonl --job 3 --job 4\n\n"
                  "  ppqa export everything.json --all\n\n"
                  "  ppqa export out.jsonl --format openai-batch   (requests ingested with "
                  "--openai-batch, one OpenAI Batch output line each, in input order)")
def export(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(
        help="Output file (.csv, .jsonl or .json), or - for standard output.")],
    format: Annotated[str | None, typer.Option(
        "--format", help="csv, jsonl, json or openai-batch (the OpenAI Batch output format, "
                         "for requests ingested with --openai-batch); default: from FILE's "
                         "extension (csv for -), e.g. --format jsonl.", show_default=False)] = None,
    job: Annotated[list[int] | None, typer.Option(
        "--job", min=1, max=MAX_ID, show_default=False,
        help="Only this job, any status (repeat for several), e.g. --job 3 --job 4.")] = None,
    all_jobs: Annotated[bool, typer.Option(
        "--all", help="Every job, finished or not (unanswered questions have an empty "
                      "answer).")] = False,
) -> None:
    from ppqa.files.export import (OPENAI_BATCH_FORMAT, check_destination, export_format,
                                   write_export)
    from ppqa.store.export import open_export

    if job and all_jobs:
        raise InputError("give --job or --all, not both")
    check_destination(file)
    fmt = export_format(file, format)
    if fmt == OPENAI_BATCH_FORMAT:
        _export_openai_batch(ctx, file, job, all_jobs)
        return
    # The rows stream from the store into the file: an export's memory stays flat however
    # many answers it holds.
    with open_export(open_store(ctx), job_ids=job or None, include_all=all_jobs) as rows:
        write_export(rows, file, fmt, rows.columns)
    where = "stdout" if file == "-" else file
    if not rows.count:
        say(f"nothing to export (no {'jobs' if all_jobs or job else 'finished jobs'}); "
            f"wrote an empty {fmt} to {where}")
    else:
        n_jobs = len(rows.jobs)
        say(f"wrote {rows.count} rows ({rows.answered} answered) of {n_jobs} job"
            f"{'s' if n_jobs != 1 else ''} to {where} as {fmt}")


def _export_openai_batch(ctx: typer.Context, file: str, job: list[int] | None,
                         all_jobs: bool) -> None:
    from ppqa.files.export import write_export
    from ppqa.openai.batch_out import output_line
    from ppqa.store.openai_results import export_results

    results = export_results(open_store(ctx), job_ids=job or None, include_all=all_jobs)
    lines = [output_line(r) for r in results]
    write_export(lines, file, "jsonl")  # one JSON object a line
    failed = sum(1 for line in lines if line["error"] is not None)
    where = "stdout" if file == "-" else file
    say(f"wrote {len(lines)} OpenAI Batch output lines ({failed} with an error) to {where}"
        + ("" if lines else " (no requests ingested with --openai-batch in that selection)"))
