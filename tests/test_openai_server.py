"""`ppqa serve` as a real process on 127.0.0.1, driven by the official `openai` client.

Two servers on the tiny dummy model (CPU, fp32), each with its own SQLite store: one with its
own `--worker` (batches to completion, chat calls from 16 threads, errors), one without (jobs
stay queued until the test runs a worker itself, so a batch is cancelled with some of it done,
and a chat call times out). Answers must equal `Engine.answer`'s for the same prompts, and a
batch file must give the same output lines through the server as through `ppqa ingest
--openai-batch` / `ppqa run` / `ppqa export --format openai-batch`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.openai_fixtures import (FERRY, MODEL, QUESTIONS, TOWN, batch_bodies, batch_file,
                                   chat_body, normalized, reference_answer)

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
ENDED = ("completed", "failed", "cancelled", "expired")


class Server:
    def __init__(self, folder: Path, *args: str) -> None:
        self.db = folder / "serve.db"
        self.log = folder / "serve.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PPQA_HOME": str(folder / "home"),
               "PPQA_API_KEY": API_KEY}
        env.pop("PPQA_DB", None)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ppqa", "--db", str(self.db), "serve", "--model", MODEL,
                 "--port", str(self.port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + 90
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"ppqa serve exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/models", timeout=2,
                             headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"ppqa serve did not start: {self.log.read_text()}"
            time.sleep(0.2)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=API_KEY, **options)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("served"), "--worker", "--device", "cpu")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idle(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("idle"), "--request-timeout", "2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


def wait_for(client, batch_id: str, statuses=ENDED, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.2)


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_batch_round_trip_matches_engine_answer_and_the_cli(served, engine, tmp_path):
    client = served.client()
    bodies = batch_bodies()
    upload = client.files.create(file=("requests.jsonl", batch_file(bodies).encode()),
                                 purpose="batch")
    assert (upload.filename, upload.purpose, upload.bytes) == \
        ("requests.jsonl", "batch", len(batch_file(bodies).encode()))
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "test"})
    assert batch.status == "validating" and batch.metadata == {"run": "test"}
    batch = wait_for(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (8, 8, 0)
    assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at
    lines = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in lines] == list(bodies)
    for line in lines:
        text, finish, tokens = reference_answer(engine, bodies[line["custom_id"]])
        for choice in line["response"]["body"]["choices"]:
            assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish)
        assert line["response"]["body"]["usage"]["completion_tokens"] == \
            tokens * len(line["response"]["body"]["choices"])
    # The same file through ppqa ingest / run / export gives the same lines.
    path, db = tmp_path / "requests.jsonl", str(tmp_path / "cli.db")
    path.write_text(batch_file(bodies), encoding="utf-8")
    for args in (["ingest", "--openai-batch", str(path), "--model", MODEL],
                 ["run", "--once", "--model", MODEL, "--device", "cpu"],
                 ["export", str(tmp_path / "out.jsonl"), "--format", "openai-batch"]):
        result = CliRunner().invoke(ppqa_app(), ["--db", db, *args])
        assert result.exit_code == 0, result.stderr
    cli_lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [normalized(x) for x in cli_lines] == [normalized(x) for x in lines]
    # Files: listed, retrieved, deleted.
    assert {upload.id, batch.output_file_id} <= {f.id for f in client.files.list()}
    assert client.batches.list().data[0].id == batch.id
    client.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def ppqa_app():
    from ppqa.cli.app import app

    return app


def test_bad_file_fails_with_its_errors(served):
    client = served.client()
    good = json.loads(batch_file({"a": chat_body(FERRY, "When?")}))
    structured = {**good["body"], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}}}}
    text = "\n".join([json.dumps(good), "{not json",
                      json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings"}),
                      json.dumps({**good, "custom_id": "c", "body": structured})])
    upload = client.files.create(file=("bad.jsonl", text.encode()), purpose="batch")
    batch = wait_for(client, client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at is not None
    errors = {e.line: e for e in batch.errors.data}
    assert sorted(errors) == [2, 3, 4]
    assert errors[2].message.startswith("bad.jsonl:2: invalid JSON")
    assert errors[3].param == "url"
    assert "the JSON schema cannot be compiled" in errors[4].message
    assert errors[4].param == "body.response_format.json_schema.schema"
    binary = client.files.create(file=("blob.jsonl", b"\x00\x01"), purpose="batch")
    batch = wait_for(client, client.batches.create(
        input_file_id=binary.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and "binary data" in batch.errors.data[0].message


def test_chat_completions_from_16_threads_about_one_document(served, engine):
    client = served.client()
    questions = [f"{q} ({i})" for i, q in enumerate(QUESTIONS * 6)][:16]
    bodies = [chat_body(TOWN, q, max_tokens=6) for q in questions]

    def ask(body):
        return client.chat.completions.create(**body)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, bodies))
    for body, reply in zip(bodies, replies):
        text, finish, tokens = reference_answer(engine, body)
        assert reply.object == "chat.completion" and reply.model == MODEL
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (text, finish)
        assert reply.usage.completion_tokens == tokens
    assert len({r.id for r in replies}) == 16
    # The calls share one document in the store: a worker claims and decodes them together.
    from sqlalchemy import text as sql

    from ppqa.store.db import open_db

    db = open_db(served.db)
    with db.read() as conn:
        documents = conn.execute(sql(  # chat calls' jobs have priority 1; only these 16 here
            "SELECT document_id, COUNT(*) FROM jobs WHERE priority = 1 GROUP BY document_id")).all()
    db.close()
    assert [n for _, n in documents] == [16]


def test_api_errors_are_openai_error_bodies(served):
    client = served.client(max_retries=0)
    refused = "the JSON schema cannot be compiled"
    with pytest.raises(openai.BadRequestError, match=refused) as info:
        client.chat.completions.create(**chat_body(FERRY, "When?", response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "money"}}}))
    assert info.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert [m.id for m in client.models.list()] == [MODEL]
    upload = client.files.create(file=("notes.txt", b"hello"), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint must be"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="tools=.* is not supported"):
        client.chat.completions.create(**chat_body(FERRY, "When?"), tools=[{
            "type": "function", "function": {"name": "f", "parameters": {}}}])
    response = httpx.post(served.url + "/chat/completions", content=b"{oops",
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_cancel_mid_batch_keeps_what_was_answered(idle, engine):
    """No worker in this server: the test runs one for exactly one job, then cancels."""
    from ppqa.store.db import open_db
    from ppqa.worker.loop import Worker, WorkerOptions
    from ppqa.worker.report import ProgressSink

    client = idle.client()
    bodies = {f"r{i}": chat_body(FERRY, q, max_tokens=4 + i) for i, q in enumerate(QUESTIONS)}
    upload = client.files.create(file=("three.jsonl", batch_file(bodies).encode()),
                                 purpose="batch")
    batch = wait_for(client, client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h").id,
        statuses=("in_progress",))
    assert batch.request_counts.total == 3 and batch.request_counts.completed == 0

    class StopAfterOneJob(ProgressSink):
        def settled(self, outcome) -> None:
            worker.request_stop("one job done")

    db = open_db(idle.db)
    worker = Worker(db, engine, WorkerOptions(model=MODEL, device="cpu", max_jobs=1),
                    StopAfterOneJob())
    assert [j.status for j in worker.run().jobs] == ["done"]
    db.close()
    assert client.batches.retrieve(batch.id).request_counts.completed == 1
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    [done] = read_lines(client, batch.output_file_id)
    assert done["custom_id"] == "r0"
    assert done["response"]["body"]["choices"][0]["message"]["content"] == \
        reference_answer(engine, bodies["r0"])[0]
    errors = read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["r1", "r2"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError, match="only validating or in-progress"):
        client.batches.cancel(batch.id)


def test_chat_call_without_a_worker_times_out_and_cancels_its_job(idle):
    client = idle.client(max_retries=0)
    with pytest.raises(openai.APIStatusError, match="is a worker running") as info:
        client.chat.completions.create(**chat_body(TOWN, "Who is the mayor?"))
    assert info.value.status_code == 504
    from sqlalchemy import text as sql

    from ppqa.store.db import open_db

    db = open_db(idle.db)
    with db.read() as conn:
        statuses = conn.execute(sql("SELECT status FROM jobs WHERE priority = 1")).scalars().all()
    db.close()
    assert statuses == ["cancelled"]


def test_a_stopping_server_ends_waiting_chat_calls_at_once(tmp_path):
    """SIGTERM while a chat call waits for a worker that never comes: the call is answered 503
    and its job cancelled within seconds, and the server exits; it used to hold the shutdown
    until the call timed out (--request-timeout, 600 s by default)."""
    import threading

    from sqlalchemy import text as sql

    from ppqa.store.db import open_db

    server = Server(tmp_path, "--request-timeout", "300")
    outcome = {}

    def ask():
        try:
            server.client(max_retries=0, timeout=120).chat.completions.create(
                **chat_body(TOWN, "Who keeps the harbour?"))
        except openai.APIStatusError as exc:
            outcome["status"], outcome["message"] = exc.status_code, str(exc)

    caller = threading.Thread(target=ask)
    caller.start()
    db = open_db(server.db)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with db.read() as conn:
                if conn.execute(sql("SELECT count(*) FROM jobs")).scalar_one():
                    break
            time.sleep(0.1)
        stopped = time.monotonic()
        server.process.terminate()
        caller.join(timeout=30)
        assert server.process.wait(timeout=30) is not None
        assert time.monotonic() - stopped < 20
        assert outcome.get("status") == 503 and "shutting down" in outcome["message"], outcome
        with db.read() as conn:
            assert conn.execute(sql("SELECT status FROM jobs")).scalars().all() == ["cancelled"]
    finally:
        db.close()
        server.stop()


def test_a_chunked_upload_past_the_limit_is_refused_as_it_arrives(tmp_path):
    """An upload without a Content-Length (chunked) that grows past --max-file-mb is refused
    413 once the limit is crossed: the answer comes while the client has sent 2 MB of a body
    that has not ended (the whole body used to be read, to a temporary file, first)."""
    server = Server(tmp_path, "--max-file-mb", "1")
    boundary = "ppqaboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            "filename=\"big.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
            conn.sendall((f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
                          ).encode())
            for chunk in [head] + [b"x" * 2**16] * 32:  # 2 MB of file, and no end
                conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                part = conn.recv(65536)
                if not part:
                    break
                reply += part
            reply = reply.decode(errors="replace")
        assert reply.startswith("HTTP/1.1 413") and "the request is larger than" in reply, reply
        good = httpx.post(server.url + "/files", headers={"Authorization": f"Bearer {API_KEY}"},
                          files={"file": ("ok.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert good.status_code == 200, good.text
    finally:
        server.stop()
