"""Reading documents, questions files (.txt, .jsonl, .csv), batch files and template names."""

import json
import sys
from pathlib import Path

import pytest

from ppqa.store.errors import InputError
from ppqa.templates import list_templates
from ppqa.files.batch_file import read_batch
from ppqa.files.inputs import read_document, read_questions, resolve_template


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def parsed(questions):
    return [(q.custom_id, q.text) for q in questions]


def test_txt_skips_blank_lines_and_comments(tmp_path):
    path = write(tmp_path, "q.txt", "# header\n\nWhen was it built?\n   \n  Who built it?  \n#x\n")
    assert parsed(read_questions(path)) == [("1", "When was it built?"), ("2", "Who built it?")]


def test_jsonl_ids_and_defaults(tmp_path):
    lines = [{"question": "A?", "id": "alpha"}, {"question": "B?"}, {"question": "C?", "id": 7}]
    path = write(tmp_path, "q.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert parsed(read_questions(path)) == [("alpha", "A?"), ("2", "B?"), ("7", "C?")]


def test_csv_with_bom_quotes_and_newlines(tmp_path):
    content = '\ufeffID,Question,notes\nq1,"Commas, and ""quotes""?",x\nq2,"Two\nlines?",\n,,\n'
    path = write(tmp_path, "q.csv", content)
    assert parsed(read_questions(path)) == [("q1", 'Commas, and "quotes"?'), ("q2", "Two\nlines?")]
    no_ids = write(tmp_path, "n.csv", "question\nOne?\nTwo?\n")
    assert parsed(read_questions(no_ids)) == [("1", "One?"), ("2", "Two?")]


@pytest.mark.parametrize("name, content, message", [
    ("q.txt", "# only a comment\n\n", r"q.txt: no questions found"),
    ("q.jsonl", '{"question": "A?"}\n{"question": "B?",\n', r"q.jsonl:2: invalid JSON"),
    ("q.jsonl", '{"question": ""}\n', r"q.jsonl:1: 'question' must be a non-empty string"),
    ("q.jsonl", '["A?"]\n', r"q.jsonl:1: expected an object"),
    ("q.jsonl", '{"question": "A?", "idx": 1}\n', r"q.jsonl:1: unknown key 'idx'"),
    ("q.jsonl", '{"question": "A?", "id": "x"}\n\n{"question": "B?", "id": "x"}\n',
     r"q.jsonl:3: duplicate question id 'x' \(first at .*q.jsonl:1\)"),
    ("q.csv", "text,id\nA?,1\n", r"q.csv:1: no 'question' column in the header"),
    ("q.csv", "id,question\n1,A?\n1,B?\n", r"q.csv:3: duplicate question id '1'"),
    ("q.csv", "", r"q.csv: empty CSV file"),
    ("q.xml", "<q/>", r"unknown questions format '.xml'"),
    ("q.txt", b"A?\n\xff\xfeB?\n", r"q.txt:2: not valid UTF-8 \(byte 0xff at offset 3\)"),
    ("q.txt", b"A?\nB\x00?\n", r"q.txt:2: binary data \(NUL byte at offset 4\)"),
])
def test_bad_questions_files_name_file_and_line(tmp_path, name, content, message):
    path = write(tmp_path, name, content)
    with pytest.raises(InputError, match=message):
        read_questions(path)


def test_document_checks(tmp_path):
    text, name = read_document(write(tmp_path, "town.txt", "Some text.\n"))
    assert (text, name) == ("Some text.\n", "town")
    for content, message in (("", "the document is empty"), (" \n\t\n", "only whitespace"),
                             (b"%PDF\x00\x01", "binary data"), (b"caf\xe9", "not valid UTF-8")):
        with pytest.raises(InputError, match=message):
            read_document(write(tmp_path, "d.txt", content))
    with pytest.raises(InputError, match="no such document"):
        read_document(tmp_path / "missing.txt")
    with pytest.raises(InputError, match="is a directory"):
        read_document(tmp_path)


def test_batch_file(tmp_path):
    write(tmp_path, "b.txt", "Doc B text.")
    lines = [{"document": "Doc A text.", "questions": ["A1?", {"question": "A2?", "id": "x"}],
              "id": "first", "max_new_tokens": 16},
             {"document_path": "b.txt", "questions": ["B1?"], "name": "bee", "priority": 3}]
    items = read_batch(write(tmp_path, "batch.jsonl", "\n".join(map(json.dumps, lines))))
    assert [(i.name, i.document_text, parsed(i.questions), i.overrides) for i in items] == [
        ("first", "Doc A text.", [("1", "A1?"), ("x", "A2?")], {"max_new_tokens": 16}),
        ("bee", "Doc B text.", [("1", "B1?")], {"priority": 3})]


@pytest.mark.parametrize("line, message", [
    ('{"questions": ["A?"]}', "exactly one of 'document' and 'document_path'"),
    ('{"document": "D", "questions": "A?"}', "'questions' must be a list"),
    ('{"document": "D", "questions": []}', "no questions found"),
    ('{"document_path": "nope.txt", "questions": ["A?"]}', "nope.txt: no such document"),
    ('{"document_path": null, "questions": ["A?"]}', "'document_path' must be a non-empty string"),
    ('{"document_path": 7, "questions": ["A?"]}', "'document_path' must be .*got 7"),
    ('{"document": "D", "questions": ["A?"], "colour": 1}', "unknown key 'colour'"),
    ('{"document": "D", "questions": ["A?", "B?", {"question": "C?", "id": 2}]}',
     "duplicate question id '2'"),
])
def test_bad_batch_lines_are_named(tmp_path, line, message):
    path = write(tmp_path, "batch.jsonl", '{"document": "ok", "questions": ["Q?"]}\n' + line)
    with pytest.raises(InputError, match=f"batch.jsonl:2.*{message}"):
        read_batch(path)


def test_questions_from_stdin_are_refused_before_it_is_read(monkeypatch):
    class Unread:
        @property
        def buffer(self):
            raise AssertionError("stdin was read")

    monkeypatch.setattr(sys, "stdin", Unread())
    with pytest.raises(InputError, match="questions cannot come from stdin.*give a file"):
        read_questions("-")


def test_templates(tmp_path):
    assert "qa" in list_templates()
    assert resolve_template("qa") == "qa"
    custom = write(tmp_path, "mine.jinja", "{{ document }}")
    assert resolve_template(str(custom)) == str(custom.resolve())
    with pytest.raises(InputError, match="unknown template 'nope' \\(built-in: .*qa"):
        resolve_template("nope")
    # a .jinja path that is not there is named as a file, not as an unknown built-in
    with pytest.raises(InputError, match="template file '.*missing.jinja' does not exist"):
        resolve_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "folder.jinja").mkdir()
    with pytest.raises(InputError, match="template file '.*folder.jinja' is not a file"):
        resolve_template(str(tmp_path / "folder.jinja"))


def test_examples_are_valid_input():
    examples = Path(__file__).resolve().parents[1] / "examples"
    text, name = read_document(examples / "harrowmere.txt")
    assert name == "harrowmere" and 1500 <= len(text.split()) <= 2500
    forms = [read_questions(examples / f"questions.{ext}") for ext in ("txt", "jsonl", "csv")]
    assert [len(f) for f in forms] == [12, 12, 12]
    assert [q.text for q in forms[0]] == [q.text for q in forms[1]] == [q.text for q in forms[2]]
    assert [q.custom_id for q in forms[1]] == [q.custom_id for q in forms[2]]
