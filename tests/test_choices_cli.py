"""Questions with choices through the whole path: ingest (every input form) -> the store (a real
SQLite file) -> `ppqa run` with a tiny model -> export (CSV, JSONL) and `ppqa show`; and the
one-line refusals of bad choices at ingest."""

from __future__ import annotations

import csv
import json
import math

import pytest

from ppqa.store.params import GenerationParams
from tests.helpers import WORKER_MODEL, cli_runner, tiny_engine

DOC = "Port Wren has three lighthouses and a ferry that leaves at noon.\n"
LABELS = ("yes", "no", "unsure")


@pytest.fixture
def cli(tmp_path):
    return cli_runner(str(tmp_path / "store.db"), COLUMNS="160")


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "doc.txt").write_text(DOC, encoding="utf-8")
    (tmp_path / "q.txt").write_text("Is Port Wren a town?\nDoes it have a ferry?\n")
    (tmp_path / "q.jsonl").write_text(
        '{"id": "count", "question": "How many lighthouses?", "choices": ["one", "two", "three"]}\n'
        '{"id": "free", "question": "When does the ferry leave?"}\n')
    (tmp_path / "q.csv").write_text('id,question,choices\nc1,"Ferry, or bridge?",ferry|bridge\n'
                                    "c2,Any ferry?,\n")
    return tmp_path


def scores_of(row: dict) -> list[dict]:
    scores = row["choice_scores"]
    return json.loads(scores) if isinstance(scores, str) else scores


def test_choices_from_ingest_to_export(cli, inputs, tmp_path):
    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--template", "label",
        "--choices", ",".join(LABELS), "--choice-norm", "char")
    cli("ingest", inputs / "doc.txt", inputs / "q.jsonl", "--template", "multiple_choice",
        "--max-new-tokens", "3")
    cli("ingest", inputs / "doc.txt", inputs / "q.csv", "--choices", "maybe,surely",
        "--max-new-tokens", "3")
    summary = json.loads(cli("run", "--once", "--json", "--device", "cpu",
                             "--model", WORKER_MODEL).stdout)
    assert summary["jobs_done"] == 3 and summary["jobs_failed"] == 0

    cli("export", tmp_path / "out.csv")
    with open(tmp_path / "out.csv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[-4:] == ["choice", "choice_prob", "choice_logprob", "choice_scores"]
    by_id = {(r["job"], r["question_id"]): r for r in rows}
    # Every question with choices has its label, and the scores of all its choices.
    expected = {("1", "1"): LABELS, ("1", "2"): LABELS, ("2", "count"): ("one", "two", "three"),
                ("3", "c1"): ("ferry", "bridge"), ("3", "c2"): ("maybe", "surely")}
    for key, labels in expected.items():
        row = by_id[key]
        scores = scores_of(row)
        assert [s["choice"] for s in scores] == list(labels)
        assert row["answer"] == row["choice"] in labels and row["finish_reason"] == "choice"
        assert math.isclose(sum(s["prob"] for s in scores), 1.0, rel_tol=1e-9)
        best = max(scores, key=lambda s: s["prob"])
        assert (best["choice"], float(row["choice_prob"]), float(row["choice_logprob"])) == (
            row["choice"], best["prob"], best["logprob"])
    # A question without choices in the same export is generated, with empty choice cells.
    free = by_id[("2", "free")]
    assert free["finish_reason"] in ("stop", "length") and free["choice"] == ""
    assert free["choice_scores"] == ""

    # The stored scores are the engine's for the same inputs (template and norm went through).
    engine = tiny_engine(WORKER_MODEL.split(":")[1])
    direct = engine.score(DOC, ["Is Port Wren a town?", "Does it have a ferry?"], list(LABELS),
                          template="label", norm="char")
    for i, answer in enumerate(direct):
        stored = scores_of(by_id[("1", str(i + 1))])
        assert [s["logprob"] for s in stored] == pytest.approx(answer.choice_logprobs, abs=1e-5)
        assert by_id[("1", str(i + 1))]["choice"] == answer.choice

    jsonl = cli("export", "-", "--format", "jsonl", "--job", "2").stdout
    lines = [json.loads(line) for line in jsonl.splitlines()]
    assert isinstance(lines[0]["choice_scores"], list) and "choice" not in lines[1]

    shown = cli("show", "2").stdout
    top = max(scores_of(by_id[("2", "count")]), key=lambda s: s["prob"])
    assert f"{top['choice']} {top['prob']:.2f} · " in shown
    report = json.loads(cli("report", "--job", "1", "--json").stdout)[0]
    assert report["questions"] == 2 and report["decode_seconds"] == 0
    assert report["prefill_seconds"] > 0


def test_batch_lines_carry_choices(cli, inputs):
    lines = [{"document_path": "doc.txt", "choices": ["red", "blue"], "choice_norm": "token",
              "questions": ["Colour?", {"question": "Size?", "choices": ["big", "small"]}]}]
    (inputs / "batch.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    cli("ingest", "--batch", inputs / "batch.jsonl")
    detail = json.loads(cli("show", "1", "--json").stdout)
    assert detail["params"]["choice_norm"] == "token"
    assert [q["choices"] for q in detail["questions_detail"]] == [["red", "blue"],
                                                                  ["big", "small"]]


@pytest.mark.parametrize("args,files,message", [
    (["--choices", "yes"], {}, "--choices: give at least two choices, got 1 ('yes')"),
    (["--choices", "yes,no,yes"], {}, "--choices: duplicate choice 'yes'"),
    (["--choices", "yes,,no"], {}, "--choices: a choice is empty"),
    (["--choices", "a,b", "--choice-norm", "bytes"], {},
     "choice_norm must be one of none, token, char, got 'bytes'"),
    ([], {"q.jsonl": '{"question": "Q?"}\n{"question": "R?", "choices": ["only"]}\n'},
     "q.jsonl:2: give at least two choices, got 1 ('only')"),
    ([], {"q.jsonl": '{"question": "Q?", "choices": "yes,no"}\n'},
     "q.jsonl:1: 'choices' must be a list of strings"),
    ([], {"q.jsonl": '{"question": "Q?", "choices": ["a", " "]}\n'},
     "q.jsonl:1: a choice is empty"),
    ([], {"q.csv": "question,choices\nQ?,a|b\nR?,a|a\n"}, "q.csv:3: duplicate choice 'a'"),
    ([], {"q.csv": "question,choices\nQ?,a|\n"}, "q.csv:2: a choice is empty"),
])
def test_bad_choices_are_refused_with_one_line(cli, inputs, args, files, message):
    questions = inputs / "q.txt"
    for name, content in files.items():
        questions = inputs / name
        questions.write_text(content)
    result = cli("ingest", inputs / "doc.txt", questions, *args, ok=False)
    assert result.exit_code == 2
    where = f"{inputs}/" if files else ""  # a file's errors name it by the path given
    assert result.stderr == f"error: {where}{message}\n"
    assert "no store there" in cli("status", ok=False).stderr  # nothing was written


def test_batch_line_choices_must_be_a_list(cli, inputs):
    (inputs / "b.jsonl").write_text(json.dumps(
        {"document": "Text.", "questions": ["Q?"], "choices": "yes"}) + "\n")
    result = cli("ingest", "--batch", inputs / "b.jsonl", ok=False)
    assert result.stderr == f"error: {inputs / 'b.jsonl'}:1: 'choices' must be a list of strings\n"


def test_params_of_jobs_without_choices_are_unchanged():
    assert "choice_norm" not in GenerationParams().to_dict()  # so their job keys stay the same
    assert GenerationParams(choice_norm="char").to_dict()["choice_norm"] == "char"
    back = GenerationParams.from_dict(GenerationParams(choice_norm="token").to_dict())
    assert back.choice_norm == "token"
