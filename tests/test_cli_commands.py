"""The store-facing commands through Typer's CliRunner: ingest (every input form), status,
jobs, show, report, export, cancel, retry; data on stdout, messages on stderr."""

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from ppqa.cli.app import app
from tests.helpers import cli_runner
from ppqa.store import queue
from ppqa.store.db import open_db

REPORT = dict(device="cpu", model="tiny", mode="parallel", wall_seconds=2.0, questions=2,
              prompt_tokens=50, answer_tokens=12, streams=2, batch_size=1,
              peak_memory_bytes=64 * 2**20)


@pytest.fixture
def cli(tmp_path):
    return cli_runner(str(tmp_path / "cli.db"))


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "doc.txt").write_text("Port Wren has three lighthouses.\n", encoding="utf-8")
    (tmp_path / "q.txt").write_text("How many lighthouses?\n# skip\nWhat town?\n")
    (tmp_path / "q.jsonl").write_text('{"question": "Lighthouses?", "id": "lh"}\n')
    (tmp_path / "q.csv").write_text('id,question\nc1,"Town, name?"\n')
    return tmp_path


def test_ingest_each_questions_format(cli, inputs):
    first = cli("ingest", inputs / "doc.txt", inputs / "q.txt")
    assert first.stdout == "1\n"
    assert "queued job 1: 2 questions about 'doc' (document 1, new)" in first.stderr
    out = json.loads(cli("ingest", inputs / "doc.txt", inputs / "q.jsonl", "--json").stdout)
    assert out == {"job": 2, "document": 1, "document_name": "doc", "document_is_new": False,
                   "questions": 1}
    cli("ingest", inputs / "doc.txt", inputs / "q.csv", "--name", "wren", "--priority", "4",
        "--max-new-tokens", "16", "--temperature", "0.5", "--seed", "9", "--mode", "parallel",
        "--model", "smollm2", "--template", "label")
    detail = json.loads(cli("show", "3", "--json").stdout)
    assert detail["params"] == {"template": "label", "max_new_tokens": 16, "temperature": 0.5,
                                "top_p": 1.0, "seed": 9, "mode": "parallel", "model": "smollm2"}
    assert detail["priority"] == 4 and detail["document_name"] == "doc"
    assert [(q["question_id"], q["question"]) for q in detail["questions_detail"]] == [
        ("c1", "Town, name?")]


def test_ingest_from_stdin_and_force(cli, inputs):
    result = cli("ingest", "-", inputs / "q.txt", "--name", "piped", input="Text from a pipe.\n")
    assert result.stdout == "1\n"
    refused = cli("ingest", "-", inputs / "q.txt", input="Text from a pipe.\n", ok=False)
    assert refused.exit_code == 2 and "job 1" in refused.stderr
    forced = cli("ingest", "-", inputs / "q.txt", "--force", input="Text from a pipe.\n")
    assert forced.stdout == "2\n"
    assert "already stored" in forced.stderr


def test_ingest_batch(cli, inputs):
    lines = [{"document_path": "doc.txt", "questions": ["A?", "B?"], "name": "wren"},
             {"document": "Inline text.", "questions": [{"question": "C?", "id": "c"}],
              "id": "inline-1", "max_new_tokens": 8}]
    (inputs / "batch.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    result = cli("ingest", "--batch", inputs / "batch.jsonl", "--json", "--priority", "2")
    assert [(r["job"], r["document_name"], r["questions"]) for r in json.loads(result.stdout)] == [
        (1, "wren", 2), (2, "inline-1", 1)]
    jobs = json.loads(cli("jobs", "--json").stdout)
    assert [(j["job"], j["priority"], j["params"]["max_new_tokens"]) for j in jobs] == [
        (2, 2, 8), (1, 2, 128)]


def answer_job(db_location, job_id, texts, report=REPORT):
    db = open_db(db_location)
    claim = queue.claim_jobs(db, "w1", 60)[0]
    assert claim.job_id == job_id
    for q, text in zip(claim.questions, texts):
        queue.record_answer(db, q.id, text, 6, "stop", worker_id="w1")
    status = queue.finish_job(db, job_id, "w1", report)
    db.close()
    return status


def test_status_jobs_show_report(cli, inputs):
    assert "no store there" in cli("status", ok=False).stderr  # a read never creates a store
    cli("ingest", inputs / "doc.txt", inputs / "q.txt")
    cli("ingest", "-", inputs / "q.jsonl", "--name", "other", input="Other text.")
    assert answer_job(cli.db, 1, ["Three.", "Port Wren."]) == "done"
    status = json.loads(cli("status", "--json").stdout)
    assert status["totals"]["jobs"]["done"] == 1 and status["totals"]["answered"] == 2
    table = cli("status").stdout
    assert "doc" in table and "other" in table and "2/2" in table and "2/3" in table
    listing = cli("jobs").stdout
    assert "done" in listing and "queued" in listing
    assert [j["job"] for j in json.loads(cli("jobs", "--status", "queued", "--json").stdout)] == [2]
    shown = cli("show", "1").stdout
    assert "Port Wren." in shown and "parallel" in shown and "64" in shown  # report: peak MiB
    reports = json.loads(cli("report", "--job", "1", "--json").stdout)
    assert len(reports) == 1 and reports[0]["tokens_per_second"] == 6.0
    assert reports[0]["peak_memory_bytes"] == 64 * 2**20
    assert "tiny" in cli("report").stdout
    assert "no reports yet" in cli("report", "--job", "2").stderr


def test_cancel_and_retry(cli, inputs):
    cli("ingest", inputs / "doc.txt", inputs / "q.txt")
    assert cli("cancel", "1").stderr == "job 1: cancelled\n"
    assert json.loads(cli("show", "1", "--json").stdout)["status"] == "cancelled"
    assert cli("retry", "1").stderr == "job 1: queued\n"
    assert json.loads(cli("show", "1", "--json").stdout)["status"] == "queued"


def test_export(cli, inputs, tmp_path):
    cli("ingest", inputs / "doc.txt", inputs / "q.txt")
    cli("ingest", inputs / "doc.txt", inputs / "q.csv")
    answer_job(cli.db, 1, ['Three, "tall"\nones.', "Port Wren"])
    out = cli("export", tmp_path / "answers.csv")
    assert "wrote 2 rows (2 answered) of 1 job" in out.stderr and out.stdout == ""
    with open(tmp_path / "answers.csv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["job", "document", "question_id", "question", "answer",
                             "finish_reason", "tokens", "model", "mode", "finished_at"]
    assert [(r["question_id"], r["answer"], r["model"]) for r in rows] == [
        ("1", 'Three, "tall"\nones.', "tiny"), ("2", "Port Wren", "tiny")]
    stdout_csv = cli("export", "-", "--all").stdout
    assert len(list(csv.DictReader(io.StringIO(stdout_csv)))) == 3
    jsonl = cli("export", "-", "--format", "jsonl", "--job", "2").stdout
    assert [json.loads(line)["question"] for line in jsonl.splitlines()] == ["Town, name?"]
    cli("export", tmp_path / "all.json", "--job", "1", "--job", "2")
    assert len(json.loads((tmp_path / "all.json").read_text(encoding="utf-8"))) == 3
    assert cli("export", "-", "--job", "1", "--all", ok=False).exit_code == 2


def test_help_explains_every_option_with_an_example():
    for command in ("ingest", "status", "jobs", "show", "export", "report", "cancel", "retry"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert f"ppqa {command}" in result.stdout  # the examples section
    ingest_help = CliRunner().invoke(app, ["ingest", "--help"], env={"COLUMNS": "200"}).stdout
    for option in ("--name", "--template", "--max-new-tokens", "--temperature", "--seed",
                   "--priority", "--json", "--batch", "--force", "--top-p", "--mode", "--model"):
        assert option in ingest_help
    from ppqa.templates import list_templates

    flat = " ".join(ingest_help.replace("│", " ").split())  # rich wraps and frames the help
    assert f"a built-in name ({', '.join(list_templates())})" in flat and "raw" in list_templates()
    assert "0.1.0" in CliRunner().invoke(app, ["--version"]).stdout


def test_the_command_list_gives_each_command_its_summary_alone():
    """`ppqa --help` lists a command by its help's first paragraph: the examples that follow
    must sit in a paragraph of their own, not run into that line."""
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert "run " in listing and "serve " in listing
    assert "Examples" not in listing


def test_run_passes_its_limits_and_peers_to_the_worker(cli, inputs, monkeypatch):
    """What `ppqa run` is told reaches the worker's options; unsaid, WorkerOptions' defaults."""
    from ppqa.worker import loop
    from ppqa.worker.options import WorkerOptions

    seen = []
    init = loop.Worker.__init__

    def recording(self, db, engine, options, progress=None):
        seen.append(options)
        init(self, db, engine, options, progress)

    monkeypatch.setattr(loop.Worker, "__init__", recording)
    for _ in range(2):
        cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--force")
    common = ("run", "--device", "cpu", "--model", "dummy:tiny-mha")
    cli(*common, "--peers", "3", "--max-jobs", "5", "--max-questions", "40")
    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--force")
    cli(*common)
    told, unsaid = seen
    assert (told.peers, told.max_jobs, told.max_questions) == (3, 5, 40)
    defaults = WorkerOptions()
    assert (unsaid.peers, unsaid.max_jobs, unsaid.max_questions) == (
        1, defaults.max_jobs, defaults.max_questions)


def test_run_once_with_nothing_to_claim_says_why_jobs_wait(cli, inputs, tmp_path):
    """Open jobs that this worker cannot take: queued for another model, or running under
    another worker's live lease. `ppqa run --once` exits 0 before loading anything and says
    which (it said only "no jobs to run")."""
    from ppqa.store import queue
    from ppqa.store.db import open_db

    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--model", "dummy:tiny-mha")
    cli("ingest", inputs / "doc.txt", inputs / "q.jsonl")  # any model
    db = open_db(tmp_path / "cli.db")
    assert queue.claim_jobs(db, "other-host", 60, model="dummy:tiny-gqa")[0].job_id == 2
    db.close()
    result = cli("run", "--once", "--device", "cpu", "--model", "dummy:tiny-gqa")
    assert result.exit_code == 0
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("no jobs to run for dummy:tiny-gqa in ")
    assert "queued jobs ask for other models (dummy:tiny-mha: 1; run those with --model)" in line
    assert "1 job running under other workers' leases (the first expires in " in line


def test_status_and_jobs_tables_stay_a_glance_over_many_documents(cli):
    """Past 20 documents the status table lists the 20 with the most open work and adds the
    rest up in one row (the columns still sum to the totals); past 50 jobs the jobs table
    lists the newest 50 and says how many there are; --all and --json list everything."""
    from ppqa.files.inputs import QuestionInput
    from ppqa.store.jobs import IngestRequest, ingest

    db = open_db(cli.db)
    ingest(db, [IngestRequest(f"Document number {i}.", f"doc{i:02d}",
                              [QuestionInput("1", "Which number?", "t:1")]) for i in range(60)])
    for _ in range(45):  # the 45 oldest answered; two more claimed and left running
        claim = queue.claim_jobs(db, "w1", 600)[0]
        queue.record_answer(db, claim.questions[0].id, "A number.", 3, "stop", worker_id="w1")
        queue.finish_job(db, claim.job_id, "w1", REPORT)
    running = [queue.claim_jobs(db, "w1", 600)[0].job_id for _ in range(2)]
    db.close()

    shown = cli("status")
    lines = shown.stdout.splitlines()
    listed = [line.split()[1] for line in lines
              if line.split()[:1] and line.split()[0].isdigit() and "more" not in line]
    # Running first, then the 13 queued, then the newest of the done ones.
    assert len(listed) == 20 and {f"doc{i - 1:02d}" for i in running} <= set(listed)
    assert {f"doc{i:02d}" for i in range(47, 60)} <= set(listed)
    assert listed == sorted(listed)  # in document order
    rest = next(line for line in lines if "40 more" in line).split()
    total = next(line for line in lines if "all documents" in line).split()
    assert rest[2:] == ["0", "0", "40", "0", "0", "40/40"]
    assert total[2:] == ["13", "2", "45", "0", "0", "45/60"]
    assert "20 of 60 documents listed" in shown.stderr and "--all" in shown.stderr
    every = cli("status", "--all").stdout
    assert "doc00" in every and "more" not in every
    assert len(json.loads(cli("status", "--json").stdout)["documents"]) == 60

    jobs = cli("jobs")
    rows = [line for line in jobs.stdout.splitlines() if line.split()[:1]
            and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == list(range(60, 10, -1))
    assert "the newest 50 of 60 jobs; --limit N or --all lists more" in jobs.stderr
    assert cli("jobs", "--status", "done").stderr == ""  # all 45 listed: nothing to say
    assert len([line for line in cli("jobs", "--all").stdout.splitlines()
                if line.split()[:1] and line.split()[0].isdigit()]) == 60
    assert cli("jobs", "--limit", "5").stderr == ""
    assert len(json.loads(cli("jobs", "--json").stdout)) == 60
    assert cli("jobs", "--all", "--limit", "3", ok=False).exit_code == 2


def test_a_large_batch_is_told_in_one_line(cli, inputs):
    """Past 20 jobs a batch ingest says what it queued in one line on stderr (a line a job
    would bury the terminal); stdout still has every job id, one a line."""
    lines = [{"document": f"Text number {i // 2}.", "questions": ["A?", "B?", "C?"],
              "name": f"n{i}"} for i in range(25)]
    (inputs / "big.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    result = cli("ingest", "--batch", inputs / "big.jsonl", "--force")
    assert result.stdout.split() == [str(i) for i in range(1, 26)]
    assert result.stderr.strip() == ("queued 25 jobs (75 questions) about 13 documents (13 new); "
                                     "their ids are on stdout, one a line (--json: each job's "
                                     "details)")
    detailed = cli("ingest", "--batch", inputs / "big.jsonl", "--force", "--json")
    assert len(json.loads(detailed.stdout)) == 25


def test_report_lists_the_latest_runs_and_says_how_many_there_are(cli):
    """Past 50 runs the report table lists the latest 50, oldest first, and says how many
    there are; --all and --json list every run."""
    from ppqa.files.inputs import QuestionInput
    from ppqa.store.jobs import IngestRequest, ingest

    db = open_db(cli.db)
    ingest(db, [IngestRequest(f"Document number {i}.", f"doc{i}",
                              [QuestionInput("1", "Which?", "t:1")]) for i in range(55)])
    for _ in range(55):
        claim = queue.claim_jobs(db, "w1", 600)[0]
        queue.record_answer(db, claim.questions[0].id, "This one.", 3, "stop", worker_id="w1")
        queue.finish_job(db, claim.job_id, "w1", REPORT)
    db.close()

    def listed(result):
        return [int(line.split()[0]) for line in result.stdout.splitlines()
                if line.split()[:1] and line.split()[0].isdigit()]

    shown = cli("report")
    assert listed(shown) == list(range(6, 56))
    assert "the latest 50 of 55 runs; --all lists every one" in shown.stderr
    every = cli("report", "--all")
    assert listed(every) == list(range(1, 56)) and every.stderr == ""
    assert len(json.loads(cli("report", "--json").stdout)) == 55
    assert listed(cli("report", "--job", "7")) == [7]
