"""Samples of questions with choices through the whole path: ingest --choices --samples 4
--temperature 0.8 --seed -> the store (a real SQLite file) -> `ppqa run` with a tiny model on
the CPU -> export (CSV and JSONL: a row per sample, with the question's vote and its share)
and `ppqa show`; the same seed in a fresh store draws the same; a job interrupted midway draws
only its missing samples, as it would have; greedy samples are still refused."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter

import pytest

from ppqa.choices import draw_choices
from ppqa.store import queue
from ppqa.store.db import open_db
from tests.helpers import WORKER_MODEL, cli_runner

N = 4
SEED = 4  # draws, on the tiny model, a 3-1 and a 2-2 question: a share below 1, and a tie
TEMPERATURE = 0.8
LABELS = ("yes", "no", "unsure")
# `label` scoring compared per character: the tiny random model then spreads its probability
# over the labels, so that draws at 0.8 differ.
HOT = ["--template", "label", "--choice-norm", "char", "--samples", N,
       "--temperature", TEMPERATURE, "--seed", SEED, "--max-new-tokens", 4]


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "doc.txt").write_text("Port Wren has three lighthouses and a ferry that "
                                      "leaves at noon.\n", encoding="utf-8")
    (tmp_path / "q.txt").write_text("Is Port Wren a town?\nDoes it have a ferry?\n"
                                    "Is the ferry late?\n", encoding="utf-8")
    # A job of samples may mix questions with choices of their own and generated ones.
    (tmp_path / "mixed.jsonl").write_text(
        '{"id": "count", "question": "How many lighthouses?", "choices": ["one", "two", "three"]}\n'
        '{"id": "free", "question": "When does the ferry leave?"}\n', encoding="utf-8")
    return tmp_path


def ingest_and_run(inputs, db: str, *questions: str) -> object:
    """`questions` files ingested with --choices yes,no,unsure (q.txt) or their own (the
    others) and HOT, then run by one worker."""
    cli = cli_runner(str(inputs / db), COLUMNS="160")
    for name in questions:
        shared = ["--choices", ",".join(LABELS)] if name == "q.txt" else []
        cli("ingest", inputs / "doc.txt", inputs / name, *shared, *HOT)
    summary = json.loads(cli("run", "--once", "--json", "--device", "cpu",
                             "--model", WORKER_MODEL).stdout)
    assert summary["jobs_failed"] == 0 and summary["jobs_done"] == len(questions)
    return cli


def csv_rows(cli, path) -> list[dict]:
    cli("export", path)
    with open(path, encoding="utf-8-sig", newline="") as f:
        return list(csv.DictReader(f))


def expected_vote(drawn: list[str], scores: list[dict]) -> tuple[str, float]:
    """The most frequent label; a tie to the higher probability, then the earlier choice."""
    counts = Counter(drawn)
    top = max(counts.values())
    tied = [s for s in scores if counts[s["choice"]] == top]
    best = max(tied, key=lambda s: s["prob"])  # max keeps the first of equal probabilities
    return best["choice"], top / len(drawn)


def test_samples_of_choices_export_a_row_each_with_the_vote(inputs):
    cli = ingest_and_run(inputs, "a.db", "q.txt", "mixed.jsonl")
    rows = csv_rows(cli, inputs / "out.csv")
    assert list(rows[0])[-7:] == ["choice", "choice_prob", "choice_logprob", "choice_scores",
                                  "sample", "vote", "vote_share"]
    by_question: dict[str, list[dict]] = {}
    for row in rows:
        by_question.setdefault(row["question_id"], []).append(row)
    assert list(by_question) == ["1", "2", "3", "count", "free"]
    assert all([int(r["sample"]) for r in group] == list(range(N))
               for group in by_question.values())
    labels_of = {"1": LABELS, "2": LABELS, "3": LABELS, "count": ("one", "two", "three")}
    shares = set()
    for qid, labels in labels_of.items():
        group = by_question[qid]
        scores = json.loads(group[0]["choice_scores"])
        assert [s["choice"] for s in scores] == list(labels)
        assert all(json.loads(r["choice_scores"]) == scores for r in group)  # scored once
        drawn = [r["choice"] for r in group]
        assert all(r["answer"] == r["choice"] and r["finish_reason"] == "choice" for r in group)
        # The draws are the job's seed's at its temperature, over the stored probabilities
        # (whose logs are the compared scores up to a constant).
        picks = draw_choices([math.log(s["prob"]) for s in scores], TEMPERATURE, SEED, N)
        assert drawn == [labels[i] for i in picks]
        vote, share = expected_vote(drawn, scores)
        assert {(r["vote"], float(r["vote_share"])) for r in group} == {(vote, share)}
        shares.add(share)
    assert 0.5 in shares, "no question's vote was a tie: the test shows no tie broken"
    # A generated question of the same job: its samples, no choice or vote cells.
    free = by_question["free"]
    assert all(r["choice"] == r["vote"] == r["vote_share"] == "" for r in free)
    assert all(r["finish_reason"] in ("stop", "length") for r in free)

    lines = [json.loads(line) for line in
             cli("export", "-", "--format", "jsonl").stdout.splitlines()]
    assert [(line["question_id"], line["sample"]) for line in lines] == [
        (r["question_id"], int(r["sample"])) for r in rows]
    for line, row in zip(lines, rows):
        if row["question_id"] == "free":
            assert "vote" not in line and "choice" not in line
        else:
            assert (line["choice"], line["vote"], line["vote_share"]) == (
                row["choice"], row["vote"], float(row["vote_share"]))

    shown = [(q["question_id"], q["sample"], q.get("vote"), q.get("vote_share"))
             for job in ("1", "2")
             for q in json.loads(cli("show", job, "--json").stdout)["questions_detail"]]
    assert shown == [(line["question_id"], line["sample"], line.get("vote"),
                      line.get("vote_share")) for line in lines]
    first = by_question["1"][0]
    assert f"vote {first['vote']} {float(first['vote_share']):.2f}" in cli("show", "1").stdout

    # The same jobs in a fresh store draw the same samples.
    again = csv_rows(ingest_and_run(inputs, "b.db", "q.txt", "mixed.jsonl"), inputs / "b.csv")
    drawn = ("question_id", "sample", "answer", "choice_scores", "vote", "vote_share")
    assert [[r[c] for c in drawn] for r in again] == [[r[c] for c in drawn] for r in rows]


def test_one_answer_of_a_choice_question_keeps_its_columns_and_the_best_choice(inputs):
    """No --samples, at a temperature: the best choice, as before; no sample or vote."""
    cli = cli_runner(str(inputs / "one.db"))
    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--choices", ",".join(LABELS),
        "--template", "label", "--choice-norm", "char", "--temperature", TEMPERATURE)
    cli("run", "--once", "--device", "cpu", "--model", WORKER_MODEL)
    rows = csv_rows(cli, inputs / "one.csv")
    assert list(rows[0])[-4:] == ["choice", "choice_prob", "choice_logprob", "choice_scores"]
    assert len(rows) == 3
    for row in rows:
        scores = json.loads(row["choice_scores"])
        assert row["choice"] == max(scores, key=lambda s: s["prob"])["choice"]
    line = json.loads(cli("export", "-", "--format", "jsonl").stdout.splitlines()[0])
    assert not {"sample", "vote", "vote_share"} & set(line)


def test_an_interrupted_choice_job_draws_only_its_missing_samples(inputs):
    """Samples 0 and 2 of the first question are in (made up here); the worker scores the
    question once more and stores only samples 1 and 3, drawn as an uninterrupted run."""
    full = ingest_and_run(inputs, "full.db", "q.txt")
    whole = {(r["question_id"], r["sample"]): r["answer"]
             for r in csv_rows(full, inputs / "full.csv")}

    cli = cli_runner(str(inputs / "part.db"))
    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--choices", ",".join(LABELS), *HOT)
    db = open_db(str(inputs / "part.db"))
    claim = queue.claim_jobs(db, "w1", 60)[0]
    first = claim.questions[0]
    made_up = [{"choice": c, "logprob": math.log(p), "prob": p}
               for c, p in zip(LABELS, (0.2, 0.2, 0.6))]
    queue.record_answers(db, [(first.id, "unsure", 1, "choice", None, made_up, 0),
                              (first.id, "unsure", 1, "choice", None, made_up, 2)],
                         worker_id="w1")
    queue.release_jobs(db, "w1", [claim.job_id])
    db.close()
    summary = json.loads(cli("run", "--once", "--json", "--device", "cpu",
                             "--model", WORKER_MODEL).stdout)
    assert summary["jobs_done"] == 1 and summary["questions_answered"] == 3 * N - 2
    part = {(r["question_id"], r["sample"]): r["answer"]
            for r in csv_rows(cli, inputs / "part.csv")}
    kept = [("1", "0"), ("1", "2")]
    assert [part.pop(k) for k in kept] == ["unsure", "unsure"]
    assert part == {k: a for k, a in whole.items() if k not in kept}


def test_greedy_samples_of_choices_are_still_refused(inputs):
    cli = cli_runner(str(inputs / "refused.db"))
    result = cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--choices", "yes,no",
                 "--samples", N, ok=False)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {N} samples need a temperature above 0: greedy decoding "
                             "gives the same answer every time\n")
    assert "no store there" in cli("status", ok=False).stderr


def test_a_choice_question_of_samples_that_cannot_fit_fails_its_job_alone(inputs):
    """The engine rejects the one request of all its samples: every sample is rejected, so the
    job fails at once (not retried) instead of waiting for samples that never come."""
    from tests.helpers import tiny_engine

    context = tiny_engine(WORKER_MODEL.split(":")[1]).model_config.max_position_embeddings
    (inputs / "huge.txt").write_text("word " * (2 * context), encoding="utf-8")
    cli = cli_runner(str(inputs / "huge.db"))
    cli("ingest", inputs / "huge.txt", inputs / "q.txt", "--choices", ",".join(LABELS), *HOT)
    cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--choices", ",".join(LABELS), *HOT)
    summary = json.loads(cli("run", "--once", "--json", "--device", "cpu",
                             "--model", WORKER_MODEL).stdout)
    assert summary["stopped_by"] is None  # ended by itself, not by a signal
    assert {j["document"]: j["status"] for j in summary["jobs"]} == {"huge": "failed",
                                                                     "doc": "done"}
    (failed,) = [j for j in summary["jobs"] if j["status"] == "failed"]
    assert f"context of {context} tokens" in failed["error"]
    detail = json.loads(cli("show", str(failed["job_id"]), "--json").stdout)
    assert detail["attempts"] == 1 and detail["answered"] == 0
