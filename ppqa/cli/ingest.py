"""`ppqa ingest`: queue a document and its questions (or a batch of them) as jobs.

Reads and checks every file and option first (`ppqa.files.inputs`, `GenerationParams`), then
opens the store and writes all jobs in one transaction (`ppqa.store.jobs.ingest`): bad input
exits 2 with the store untouched. Job ids go to stdout, one a line (or JSON with --json).
"""

from pathlib import Path
from typing import Annotated

import typer

from ppqa.cli.common import JsonOption, open_store, print_json, say
from ppqa.store.errors import InputError
from ppqa.choices import CHOICE_NORMS
from ppqa.files.batch_file import read_batch
from ppqa.files.inputs import (MAX_INPUT_BYTES, parse_choices, read_document, read_json_schema,
                               read_questions, read_template, with_choices)
from ppqa.modes import MODES
from ppqa.store.params import GenerationParams
from ppqa.templates import list_templates

app = typer.Typer()

# A batch of more jobs than this is told in one line on stderr, not a line a job.
INGEST_LINES = 20

EXAMPLES = """

Examples:

  ppqa ingest examples/harbor.txt examples/questions.txt

  ppqa ingest report.txt questions.csv --name q3-report --max-new-tokens 64 --priority 5

  cat notes.txt | ppqa ingest - questions.jsonl --json

  ppqa ingest --batch many.jsonl

  ppqa ingest report.txt questions.txt --json-schema record.json

  ppqa ingest reviews.txt aspects.txt --template label --choices "positive,negative,neutral"

  ppqa ingest report.txt questions.txt --samples 8 --temperature 0.8 --seed 7

  ppqa ingest reviews.txt aspects.txt --choices "yes,no" --samples 8 --temperature 0.8

  ppqa ingest --openai-batch requests.jsonl --model smollm2
"""


@app.command(help="Queue a document and its questions as a job." + EXAMPLES)
def ingest(
    ctx: typer.Context,
    document: Annotated[str | None, typer.Argument(
        help="The document: a UTF-8 text file, or - for standard input.", show_default=False)] = None,
    questions: Annotated[str | None, typer.Argument(
        help="Questions: .txt (one a line; blank lines and # comments skipped), .jsonl "
             '({"question": ..., "id": ..., "choices": [...]} a line) or .csv (a question '
             "column, optional id and choices, the labels separated by |).",
        show_default=False)] = None,
    batch: Annotated[Path | None, typer.Option(
        "--batch", help='Many documents at once: a .jsonl file, one {"document": "..." | '
                        '"document_path": "...", "questions": [...], "name": ..., "id": ...} a '
                        "line; a line may also set template, max_new_tokens, temperature, top_p, "
                        "seed, mode, model, priority, samples, choices, choice_norm or "
                        "json_schema.", show_default=False)] = None,
    openai_batch: Annotated[Path | None, typer.Option(
        "--openai-batch", help="An OpenAI Batch file: one {\"custom_id\", \"method\": \"POST\", "
                               '"url": "/v1/chat/completions", "body": {...}} a line. Prompts are '
                               "rendered with --model's chat template (default smollm2) and "
                               "grouped by shared prefix, one document per group; each line "
                               "carries its own max_tokens, temperature, top_p, seed, stop and n. "
                               "Read back with ppqa export --format openai-batch.",
        show_default=False)] = None,
    name: Annotated[str | None, typer.Option(
        help="Document name shown in status and exports, e.g. --name q3-report. "
             "Default: the file name without extension.", show_default=False)] = None,
    template: Annotated[str, typer.Option(
        help=f"Prompt template: a built-in name ({', '.join(list_templates())}) or a path "
             "to a .jinja file, e.g. --template label.")] = "qa",
    model: Annotated[str | None, typer.Option(
        help="Model this job needs, e.g. --model smollm2; only workers running it take the "
             "job. Default: any worker's model.", show_default=False)] = None,
    mode: Annotated[str, typer.Option(
        help=f"Engine mode: {', '.join(MODES)}, e.g. --mode parallel.")] = "auto",
    max_new_tokens: Annotated[int, typer.Option(
        help="Most tokens generated per answer, e.g. --max-new-tokens 64.")] = 128,
    temperature: Annotated[float, typer.Option(
        help="Sampling temperature; 0 is greedy, e.g. --temperature 0.7.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, e.g. --top-p 0.9.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (per question), e.g. --seed 7.")] = 0,
    priority: Annotated[int, typer.Option(
        help="Higher runs first, e.g. --priority 10.")] = 0,
    choices: Annotated[str | None, typer.Option(
        help="Answer every question by choosing one of these comma-separated labels, scored "
             "by log-probability (no generation), e.g. --choices \"yes,no,unsure\"; questions "
             "with choices of their own keep them.", show_default=False)] = None,
    samples: Annotated[int, typer.Option(
        help="Answers drawn per question, each from its own seed derived from --seed; needs "
             "--temperature above 0; the export has a row per sample, e.g. --samples 8. A "
             "question with choices is scored once and its samples drawn from its choices' "
             "probabilities at the temperature; its rows carry the vote and its share.")] = 1,
    choice_norm: Annotated[str, typer.Option(
        help=f"How choices are compared: {', '.join(CHOICE_NORMS)} (summed log-probability; "
             "per token; per character, as lm-evaluation-harness's acc_norm), e.g. "
             "--choice-norm char.")] = "none",
    force: Annotated[bool, typer.Option(
        "--force", help="Queue the job even if an identical one is already in the store.")] = False,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Answer in JSON that follows this JSON schema (a .json file): "
                              "decoding is masked to it and the answer ends where the JSON "
                              "does; a batch line may give its own json_schema object, e.g. "
                              "--json-schema record.json.", show_default=False)] = None,
    max_input_mb: Annotated[float, typer.Option(
        min=0.001, max=1e6, help="Most MiB read from any one input (document, questions file, "
                                 "batch file, template); larger ones and endless streams are "
                                 "refused, e.g. --max-input-mb 64.")] = MAX_INPUT_BYTES / 2**20,
    json_out: JsonOption = False,
) -> None:
    from ppqa.store.jobs import ingest as ingest_jobs  # sqlalchemy: only when ingesting

    options = {"template": template, "max_new_tokens": max_new_tokens,
               "temperature": temperature, "top_p": top_p, "seed": seed, "mode": mode,
               "model": model, "priority": priority, "choice_norm": choice_norm,
               "samples": samples}
    limit = int(max_input_mb * 2**20)
    if json_schema is not None:
        if openai_batch is not None:
            raise InputError("--json-schema does not apply to --openai-batch (a request asks "
                             "for JSON with its own response_format)")
        options["json_schema"] = read_json_schema(json_schema, limit)
    shared = None if choices is None else parse_choices(choices, ",", "--choices")
    if shared is not None and json_schema is not None:
        raise InputError("--choices and --json-schema do not go together: a question with "
                         "choices is answered by choosing one, not by generating JSON")
    if openai_batch is not None:
        if document is not None or questions is not None or batch is not None or name:
            raise InputError("--openai-batch FILE takes no DOCUMENT, QUESTIONS, --batch or --name")
        if shared is not None:
            raise InputError("--choices does not apply to --openai-batch requests")
        _ingest_openai_batch(ctx, openai_batch, model or "smollm2", priority, force, json_out,
                             limit)
        return
    if batch is not None:
        if document is not None or questions is not None:
            raise InputError("give either DOCUMENT QUESTIONS or --batch FILE, not both")
        if name is not None:
            raise InputError("--name applies to one document; in a batch give each line a name")
        requests = [_request(item.document_text, item.name, _chosen(item.questions, shared),
                             {**options, **item.overrides}, item.where, limit)
                    for item in read_batch(batch, limit)]
    else:
        if document is None or questions is None:
            raise InputError("give a DOCUMENT and a QUESTIONS file (or --batch FILE); "
                             "see 'ppqa ingest --help'")
        text, default_name = read_document(document, limit)
        requests = [_request(text, name or default_name,
                             _chosen(read_questions(questions, limit), shared), options, "",
                             limit)]
    results = ingest_jobs(open_store(ctx, create=True), requests, force=force)
    if json_out:
        print_json([r.to_dict() for r in results] if batch is not None else results[0].to_dict())
    else:
        for r in results:
            print(r.job_id)
    if len(results) > INGEST_LINES:
        questions = sum(r.question_count for r in results)
        documents = len({r.document_id for r in results})
        new = sum(r.document_is_new for r in results)
        say(f"queued {len(results):,} jobs ({questions:,} questions) about {documents:,} "
            f"documents ({new:,} new); their ids are on stdout, one a line (--json: each "
            "job's details)")
        return
    for r in results:
        stored = "new" if r.document_is_new else "already stored"
        plural = "s" if r.question_count != 1 else ""
        say(f"queued job {r.job_id}: {r.question_count} question{plural} about "
            f"{r.document_name!r} (document {r.document_id}, {stored})")


def _ingest_openai_batch(ctx, path: Path, model: str, priority: int, force: bool,
                         json_out: bool, limit: int) -> None:
    from ppqa.openai.batch_in import ingest_batch_file
    from ppqa.openai.prompt_model import load_prompt_model

    db = open_store(ctx, create=True)  # an unreachable store fails before the tokenizer loads
    batch, results, plan = ingest_batch_file(db, path, load_prompt_model(model),
                                             priority=priority, force=force, max_bytes=limit)
    if json_out:
        print_json({"batch": batch.public_id, "requests": plan.request_count,
                    "groups": [{"requests": n, "document_tokens": t} for n, t in
                               zip(plan.group_sizes, plan.group_shared_tokens)],
                    "jobs": [r.to_dict() for r in results]})
    else:
        for r in results:
            print(r.job_id)
    say(f"queued batch {batch.public_id} for model {model}: {plan.summary()}")


def _chosen(questions, shared):
    return questions if shared is None else with_choices(questions, shared)


def _request(text, name, questions, options: dict, where: str, limit: int):
    """An IngestRequest from options; bad values become InputError naming `where`."""
    from ppqa.store.jobs import IngestRequest

    opts = dict(options)
    priority = opts.pop("priority")
    try:
        if not isinstance(opts["template"], str):
            raise InputError(f"template must be a name or a path, got {opts['template']!r}")
        opts["template"], source = read_template(opts["template"], limit)
        params = GenerationParams(**opts)
        return IngestRequest(text, name, questions, params, priority, where, source)
    except InputError as exc:
        raise InputError(f"{where}: {exc}" if where and not str(exc).startswith(where) else str(exc))
