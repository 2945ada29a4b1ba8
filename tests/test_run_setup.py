"""`ppqa run` refuses a bad setup before it claims anything: one line, exit code 2, queue unchanged.

Each case queues a job, runs the command through Typer's CliRunner (in process, so the suite
pays for torch's import once) and checks the message and that the job is still queued with no
attempt and no lease: a worker that cannot work must not take jobs from those that can.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from ppqa.cli.app import app
from ppqa.store.models import Job


def _job_state(db, job_id: int):
    with db.read() as conn:
        return tuple(conn.execute(select(Job.status, Job.attempts, Job.lease_owner)
                                  .where(Job.id == job_id)).one())


@pytest.mark.parametrize("args, message", [
    (["--model", "dummy:no-such-preset"], "cannot load model 'dummy:no-such-preset'"),
    (["--model", "/nowhere/model.gguf"], "cannot load model '/nowhere/model.gguf'"),
    (["--gpu", "99"], "GPU"),
    (["--gpu", "0", "--device", "cpu"], "give --gpu N or --device, not both"),
    (["--device", "tpu"], "device 'tpu'"),
    (["--mode", "fast"], "unknown --mode 'fast'"),
    (["--streams", "0"], "--streams must be a whole number >= 1 or 'auto'"),
    (["--streams", "many"], "--streams must be a whole number >= 1 or 'auto'"),
    (["--warmup", "never"], "--warmup must be 'always' or 'cold'"),
])
def test_bad_setup_exits_2_before_claiming(sqlite_db, sqlite_path, add_job, args, message):
    job = add_job(sqlite_db)
    base = ["--model", "dummy:tiny-mha"] if "--model" not in args else []
    base += ["--device", "cpu"] if "--device" not in args and "--gpu" not in args else []
    result = CliRunner().invoke(app, ["--db", str(sqlite_path), "run", *base, *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert _job_state(sqlite_db, job) == ("queued", 0, None)


def test_unreachable_database_exits_2(tmp_path):
    url = "postgresql+psycopg://nobody@127.0.0.1:9/none"  # port 9 (discard): nothing listens
    result = CliRunner().invoke(app, ["--db", url, "run", "--device", "cpu",
                                      "--model", "dummy:tiny-mha"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot open database")
