"""OpenAI Batch files through the CLI: `ingest --openai-batch`, `run`, `export --format
openai-batch`, on the tiny dummy model; answers equal Engine.answer's for the same prompts."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cli_runner
from tests.openai_fixtures import (FERRY, MODEL, batch_bodies, batch_file, chat_body,
                                   reference_answer)


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


@pytest.fixture
def cli(tmp_path):
    return cli_runner(str(tmp_path / "cli.db"))


def export_lines(cli, *args) -> list[dict]:
    out = cli("export", "-", "--format", "openai-batch", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_batch_file_in_and_out_matches_engine_answer(cli, tmp_path, engine):
    bodies = batch_bodies()
    path = tmp_path / "requests.jsonl"
    path.write_text(batch_file(bodies), encoding="utf-8")
    queued = cli("ingest", "--openai-batch", path, "--model", MODEL)
    job_ids = [int(x) for x in queued.stdout.split()]
    assert "8 requests in 3 shared-prefix groups" in queued.stderr
    assert "ignored 'model' (7 requests)" in queued.stderr
    assert len(job_ids) == 5  # ferry, ferry with max_tokens 7 x 2 seeds, town, solo
    pending = export_lines(cli, "--all")
    assert {line["error"]["code"] for line in pending} == {"not_finished"}
    assert export_lines(cli) == []  # by default only requests whose jobs are all done
    cli("run", "--once", "--model", MODEL, "--device", "cpu")
    lines = export_lines(cli)
    assert [line["custom_id"] for line in lines] == list(bodies)  # input order, each once
    for line in lines:
        body = bodies[line["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        completion = line["response"]["body"]
        assert completion["object"] == "chat.completion" and completion["model"] == MODEL
        text, finish, tokens = reference_answer(engine, body)
        choices = completion["choices"]
        assert len(choices) == body.get("n", 1)
        for i, choice in enumerate(choices):  # greedy: every choice is the same answer
            assert choice["index"] == i and choice["message"]["role"] == "assistant"
            assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish)
        usage = completion["usage"]
        assert usage["completion_tokens"] == tokens * len(choices)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    contents = {line["response"]["body"]["choices"][0]["message"]["content"] for line in lines}
    assert len(contents) == len(lines)  # answers differ, so a mix-up of requests would show
    assert export_lines(cli, "--job", job_ids[-1]) == [lines[6]]  # solo's own job


def test_bad_batch_file_changes_nothing(cli, tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": chat_body(FERRY, "When?")})
    structured = json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                             "body": chat_body(FERRY, "When?", response_format={
                                 "type": "json_schema", "json_schema": {"name": "x"}})})
    path.write_text(good + "\n" + structured + "\n", encoding="utf-8")
    result = cli("ingest", "--openai-batch", path, "--model", MODEL, ok=False)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: bad.jsonl:2: body: response_format of type "
                                    "json_schema needs")
    path.write_text(good + "\n" + good + "\n", encoding="utf-8")
    result = cli("ingest", "--openai-batch", path, "--model", MODEL, ok=False)
    assert result.exit_code == 2 and "bad.jsonl:2: duplicate custom_id 'a'" in result.stderr
    assert json.loads(cli("jobs", "--json").stdout) == []
    result = cli("ingest", "--openai-batch", path, "--name", "x", ok=False)
    assert result.exit_code == 2 and "takes no DOCUMENT" in result.stderr


def test_a_cancelled_request_exports_as_an_error(cli, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(batch_file({"only": chat_body(FERRY, "When?")}), encoding="utf-8")
    job = cli("ingest", "--openai-batch", path, "--model", MODEL).stdout.strip()
    cli("cancel", job)
    [line] = export_lines(cli, "--all")
    assert line["custom_id"] == "only" and line["response"] is None
    assert line["error"]["code"] == "batch_cancelled"


def test_serve_refuses_a_bad_model_before_listening(cli):
    result = cli("serve", "--model", "dummy:nope", ok=False)
    assert result.exit_code == 2
    assert "cannot load the tokenizer of model 'dummy:nope'" in result.stderr
    result = cli("serve", "--model", MODEL, "--mode", "fastest", ok=False)
    assert result.exit_code == 2 and "--mode" in result.stderr
