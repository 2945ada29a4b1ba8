"""Bad input: exit code 2, ONE line on stderr saying what and where, nothing on stdout, and the
store exactly as it was (compared as a full SQL dump, or byte for byte when it is not a
database)."""

import re
import sqlite3

import pytest
from typer.testing import CliRunner

from ppqa.cli.app import app

GOOD_QUESTIONS = "When?\nWhere?\n"


def dump(path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return list(conn.iterdump())


@pytest.fixture
def files(tmp_path):
    """A directory of good and bad inputs, and a store that already holds one job."""
    def put(name, content):
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(tmp_path / name)

    f = {
        "doc": put("doc.txt", "The bridge was built in 1850.\n"),
        "questions": put("q.txt", GOOD_QUESTIONS),
        "empty": put("empty.txt", ""),
        "blank": put("blank.txt", "  \n\n\t "),
        "binary": put("bin.txt", b"text\x00more"),
        "latin1": put("latin1.txt", "line one\ncaf\xe9\n".encode("latin-1")),
        "no_questions": put("none.txt", "# just a comment\n\n"),
        "bad_jsonl": put("bad.jsonl", '{"question": "A?"}\n{"question": "B?"\n'),
        "bad_csv": put("bad.csv", "text,id\nA?,1\n"),
        "dup_ids": put("dup.jsonl", '{"question": "A?", "id": 1}\n{"question": "B?", "id": 1}\n'),
        "bad_batch": put("batch.jsonl", '{"document": "D", "questions": ["Q?"]}\n{"document": \n'),
        # An unterminated quote must not swallow the rows after it.
        "open_quote": put("open.csv",
                          'id,question\n1,"Unterminated question?\n2,Second?\n3,Third?\n'),
        "nan_jsonl": put("nan.jsonl", '{"question": "A?", "id": NaN}\n'),
        "huge_jsonl": put("huge.jsonl", '{"question": "A?", "id": 1e999}\n'),
        "surrogate_jsonl": put("sur.jsonl", '{"question": "A \\ud800?"}\n'),
        "include_template": put("inc.jinja", "{% block prefix %}{% include 'x' %}{% endblock %}"
                                             "{% block question %}{{ question }}{% endblock %}"),
        "big_doc": put("big.txt", "word " * 1000),
        "big_batch": put("bigbatch.jsonl", '{"document_path": "big.txt", "questions": ["Q?"]}\n'),
        "dir": str(tmp_path),
        "missing": str(tmp_path / "missing.txt"),
        "db": str(tmp_path / "store.db"),
    }
    result = CliRunner().invoke(app, ["--db", f["db"], "ingest", f["doc"], f["questions"]])
    assert result.exit_code == 0, result.stderr
    return f


CASES = [
    # (id, args with {placeholders}, message regex)
    ("missing file", "ingest {missing} {questions}", r"missing\.txt: no such document"),
    ("directory", "ingest {dir} {questions}", r"is a directory, not a document"),
    ("empty document", "ingest {empty} {questions}", r"empty\.txt: the document is empty"),
    ("whitespace document", "ingest {blank} {questions}", r"blank\.txt: the document is only whitespace"),
    ("binary document", "ingest {binary} {questions}", r"bin\.txt:1: binary data \(NUL byte"),
    ("invalid utf-8", "ingest {latin1} {questions}", r"latin1\.txt:2: not valid UTF-8"),
    ("missing questions", "ingest {doc} {missing}", r"missing\.txt: no such questions file"),
    ("questions dir", "ingest {doc} {dir}", r"is a directory, not a questions file"),
    ("no questions", "ingest {doc} {no_questions}", r"none\.txt: no questions found"),
    ("malformed jsonl", "ingest {doc} {bad_jsonl}", r"bad\.jsonl:2: invalid JSON"),
    ("csv without question", "ingest {doc} {bad_csv}", r"bad\.csv:1: no 'question' column"),
    ("duplicate ids", "ingest {doc} {dup_ids}", r"dup\.jsonl:2: duplicate question id '1'"),
    ("unknown template", "ingest {doc} {questions} --template nope", r"unknown template 'nope'"),
    ("missing template file", "ingest {doc} {questions} --template {dir}/none.jinja",
     r"template file '.*none\.jinja' does not exist"),
    ("questions from stdin", "ingest {doc} -", r"questions cannot come from stdin \('-'\)"),
    ("zero max tokens", "ingest {doc} {questions} --max-new-tokens 0",
     r"max_new_tokens must be at least 1, got 0"),
    ("negative max tokens", "ingest {doc} {questions} --max-new-tokens -3",
     r"max_new_tokens must be at least 1, got -3"),
    ("negative temperature", "ingest {doc} {questions} --temperature -1", r"temperature must be"),
    ("unknown mode", "ingest {doc} {questions} --mode fast", r"unknown mode 'fast'"),
    ("not a number", "ingest {doc} {questions} --max-new-tokens many", r"Invalid value"),
    ("malformed batch", "ingest --batch {bad_batch}", r"batch\.jsonl:2: invalid JSON"),
    ("batch and files", "ingest {doc} {questions} --batch {bad_batch}", r"not both"),
    ("identical job", "ingest {doc} {questions}", r"identical job .*job 1 .*--force"),
    ("unknown job", "show 99", r"no job 99"),
    ("cancel unknown", "cancel 99", r"no job 99"),
    ("retry queued", "retry 1", r"job 1 is queued; only failed or cancelled"),
    ("export unknown job", "export - --job 99", r"no job 99"),
    ("export bad format", "export {dir}/x.xml", r"cannot tell the format"),
    ("export into a dir", "export {dir}", r": is a directory"),
    ("jobs bad status", "jobs --status sleeping", r"unknown status 'sleeping'"),
    # A CSV quote never closed.
    ("unterminated csv quote", "ingest {doc} {open_quote}",
     r"open\.csv:2: malformed CSV \(a quoted field opened on line 2 is never closed\)"),
    # Item 1: a template that cannot render, numbers out of range.
    ("template that fails", "ingest {doc} {questions} --template {include_template}",
     r"inc\.jinja.*TypeError.*no loader"),
    ("seed out of range", "ingest {doc} {questions} --seed 99999999999999999999999",
     r"seed must be a whole number from 0 to 9223372036854775807"),
    ("priority out of range", "ingest {doc} {questions} --priority 99999999999",
     r"priority must be from -2147483647 to 2147483647"),
    ("budget out of range", "ingest {doc} {questions} --max-new-tokens 99999999999",
     r"max_new_tokens must be at most 1,000,000"),
    # Item 6: out-of-range ids and counts are usage errors, not driver overflows.
    ("huge job id", "show 99999999999999999999", r"less than or equal to 2147483647"),
    ("huge cancel id", "cancel 99999999999999999999", r"less than or equal to 2147483647"),
    ("huge export job", "export - --job 99999999999999999999", r"less than or equal to 2147483647"),
    ("huge limit", "jobs --limit 99999999999999999999", r"less than or equal to 2147483647"),
    ("huge lease", "run --lease-seconds 1e300", r"less than or equal to 86400"),
    # Item 8: a bounded read.
    ("document over the limit", "ingest {big_doc} {questions} --max-input-mb 0.002",
     r"big\.txt: the document is longer than the limit of 2,097 bytes "
     r"\(raise it with --max-input-mb\)"),
    ("batch document over the limit", "ingest --batch {big_batch} --max-input-mb 0.002",
     r"bigbatch\.jsonl:1: .*big\.txt: the document is longer than the limit"),
    # Item 9: strict JSON.
    ("NaN in jsonl", "ingest {doc} {nan_jsonl}",
     r"nan\.jsonl:1: invalid JSON \(NaN is not a JSON value\)"),
    ("huge number in jsonl", "ingest {doc} {huge_jsonl}",
     r"huge\.jsonl:1: invalid JSON \(the number 1e999"),
    ("lone surrogate in jsonl", "ingest {doc} {surrogate_jsonl}",
     r"sur\.jsonl:1: invalid JSON \(a string holds a lone surrogate"),
]


@pytest.mark.parametrize("args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_changes_nothing(files, args, message):
    before = dump(files["db"])
    result = CliRunner().invoke(app, ["--db", files["db"], *args.format(**files).split()])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]
    assert dump(files["db"]) == before


def test_corrupt_database_file(tmp_path, files):
    bad = tmp_path / "corrupt.db"
    bad.write_bytes(b"SQLite format 2\x00" + bytes(range(256)) * 8)
    before = bad.read_bytes()
    for args in (["status"], ["ingest", files["doc"], files["questions"]], ["export", "-"]):
        result = CliRunner().invoke(app, ["--db", str(bad), *args])
        assert result.exit_code == 2
        assert result.stderr == f"error: cannot open database {bad}: file is not a database\n"
    assert bad.read_bytes() == before


@pytest.mark.parametrize("location, message", [
    ("{dir}", "it is a directory"),
    ("{doc}/inside.db", "there is no store there"),
    ("postgresql+psycopg://postgres@127.0.0.1:1/test", "connection"),
])
def test_unusable_database_location(files, location, message):
    result = CliRunner().invoke(app, ["--db", location.format(**files), "status"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot open database ")
    assert message in lines[0]


def test_rejected_ingest_does_not_create_a_store(tmp_path, files):
    fresh = tmp_path / "fresh.db"
    result = CliRunner().invoke(app, ["--db", str(fresh), "ingest", files["empty"],
                                      files["questions"]])
    assert result.exit_code == 2 and not fresh.exists()


def test_bad_batch_values_name_their_line(files, tmp_path):
    batch = tmp_path / "values.jsonl"
    batch.write_text('{"document": "D1", "questions": ["Q?"]}\n'
                     '{"document": "D2", "questions": ["Q?"], "max_new_tokens": "lots"}\n')
    before = dump(files["db"])
    result = CliRunner().invoke(app, ["--db", files["db"], "ingest", "--batch", str(batch)])
    assert result.exit_code == 2
    assert result.stderr == (f"error: {batch}:2: max_new_tokens must be a whole number, "
                             "got 'lots'\n")
    assert dump(files["db"]) == before
