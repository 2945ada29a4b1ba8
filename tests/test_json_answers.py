"""JSON answers through the product: `ppqa ingest --json-schema` and a batch line's
`json_schema` (checked at ingest: a schema the library cannot compile is refused in one line,
naming the file and line, with the store untouched), the job's params (old jobs' keys unchanged),
then `ppqa run` and `ppqa export` on a real SQLite file: JSONL and JSON hold the answers as
objects that validate, CSV their JSON text; and the OpenAI batch path's `response_format`
(`json_schema` and `json_object`) through `ppqa ingest --openai-batch`."""

from __future__ import annotations

import csv
import io
import json

import jsonschema
import pytest

from tests.helpers import cli_runner, parses_as_json
from ppqa.store.errors import InputError
from ppqa.store.params import GenerationParams
from tests.openai_fixtures import FERRY, MODEL, batch_file, chat_body

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "reason": {"type": "string", "maxLength": 8},
    },
    "required": ["label", "score", "reason"],
    "additionalProperties": False,
}
UNCOMPILABLE = {"type": "array", "uniqueItems": True}


@pytest.fixture
def cli(tmp_path):
    return cli_runner(str(tmp_path / "answers.db"))


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "doc.txt").write_text("Port Wren has three lighthouses and one harbour.\n")
    (tmp_path / "q.txt").write_text("Is there a harbour?\nHow many lighthouses?\nWho lives there?\n")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "bad_schema.json").write_text(json.dumps(UNCOMPILABLE))
    return tmp_path


def test_params_keep_the_schema_and_old_jobs_their_keys() -> None:
    plain = GenerationParams()
    assert "json_schema" not in plain.to_dict()  # a job without a schema keeps its key
    with_schema = GenerationParams(json_schema=SCHEMA)
    assert with_schema.to_dict()["json_schema"] == SCHEMA  # stored as the object
    assert GenerationParams.from_dict(with_schema.to_dict()) == with_schema
    assert list(json.loads(with_schema.json_schema)["properties"]) == ["label", "score", "reason"]
    with pytest.raises(InputError, match="cannot be compiled: Unimplemented keys"):
        GenerationParams(json_schema=UNCOMPILABLE)
    with pytest.raises(InputError, match="stop strings cannot be combined"):
        GenerationParams(json_schema=SCHEMA, stop=("}",))


def test_ingest_refuses_a_schema_it_cannot_compile_in_one_line(cli, inputs) -> None:
    result = cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--json-schema",
                 inputs / "bad_schema.json", ok=False)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {inputs / 'bad_schema.json'}: the JSON schema cannot be "
                             'compiled: Unimplemented keys: ["uniqueItems"]\n')
    (inputs / "broken.json").write_text('{"type": "object",\n  "properties": }')
    result = cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--json-schema",
                 inputs / "broken.json", ok=False)
    assert result.exit_code == 2 and f"{inputs / 'broken.json'}:2: invalid JSON" in result.stderr
    batch = inputs / "batch.jsonl"
    lines = [{"document": "One.", "questions": ["A?"], "json_schema": SCHEMA},
             {"document": "Two.", "questions": ["B?"], "json_schema": {"type": "nonsense"}}]
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = cli("ingest", "--batch", batch, ok=False)
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"error: {batch}:2: json_schema: the JSON schema cannot be "
                                    "compiled: ")
    assert "no store there" in cli("jobs", ok=False).stderr  # refused before the store opened


def test_ingest_run_export_writes_objects_that_validate(cli, inputs, tmp_path) -> None:
    job = cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--json-schema",
              inputs / "schema.json", "--max-new-tokens", "96").stdout.strip()
    plain = cli("ingest", inputs / "doc.txt", inputs / "q.txt", "--max-new-tokens", "6")
    assert json.loads(cli("show", job, "--json").stdout)["params"]["json_schema"] == SCHEMA
    shown = " ".join(cli("show", job).stdout.split())  # the table, its wrapping undone
    assert "json_schema={\"type\": \"object\"" in shown  # JSON, not a Python dict
    cli("run", "--once", "--model", "dummy:tiny-gqa", "--device", "cpu")
    rows = [json.loads(line) for line in cli("export", "-", "--format", "jsonl").stdout.splitlines()]
    schema_rows = [r for r in rows if str(r["job"]) == job]
    assert len(schema_rows) == 3
    for row in schema_rows:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(row["answer"], SCHEMA)  # an object, not its text
    assert all(isinstance(r["answer"], str) for r in rows if str(r["job"]) == plain.stdout.strip())
    cli("export", tmp_path / "answers.json")
    whole = json.loads((tmp_path / "answers.json").read_text())
    assert [r["answer"] for r in whole if str(r["job"]) == job] == [r["answer"] for r in schema_rows]
    cli("export", tmp_path / "answers.csv")
    table = list(csv.DictReader(io.StringIO((tmp_path / "answers.csv").read_text("utf-8-sig"))))
    texts = [r["answer"] for r in table if r["job"] == job]
    assert [json.loads(t) for t in texts] == [r["answer"] for r in schema_rows]


def test_openai_batch_response_format_answers_in_json(cli, tmp_path) -> None:
    record = {"type": "json_schema", "json_schema": {"name": "ferry", "strict": True,
                                                     "schema": SCHEMA}}
    bodies = {"schema": chat_body(FERRY, "Is it free for children?", max_tokens=96,
                                  response_format=record),
              "object": chat_body(FERRY, "When does it leave?", max_tokens=200,
                                  response_format={"type": "json_object"}),
              "text": chat_body(FERRY, "How much?", response_format={"type": "text"})}
    path = tmp_path / "requests.jsonl"
    path.write_text(batch_file(bodies), encoding="utf-8")
    cli("ingest", "--openai-batch", path, "--model", MODEL)
    cli("run", "--once", "--model", MODEL, "--device", "cpu")
    out = cli("export", "-", "--format", "openai-batch").stdout
    contents = {line["custom_id"]: line["response"]["body"]["choices"][0]
                for line in map(json.loads, out.splitlines())}
    assert contents["schema"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(contents["schema"]["message"]["content"]), SCHEMA)
    assert contents["object"]["finish_reason"] == "stop"
    assert isinstance(json.loads(contents["object"]["message"]["content"]), dict)
    assert not parses_as_json(contents["text"]["message"]["content"])  # free text stays free

