"""The installed `ppqa` console script in real processes: the main path end to end, exit codes,
stdout/stderr separation, NO_COLOR, and that store commands never import torch."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "ppqa"
COLOR = re.compile(r"\x1b\[[0-9;]*(3[0-7]|9[0-7]|38;[0-9;]+)m")  # a foreground colour code


@pytest.fixture
def run(tmp_path, ppqa_home):
    assert SCRIPT.exists(), f"{SCRIPT} missing: install the package (make setup)"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS")}
    env.update(PPQA_HOME=str(ppqa_home), PPQA_DB=str(tmp_path / "sub.db"))

    def _run(*args, extra_env=None, input=None):
        return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                              env={**env, **(extra_env or {})}, input=input, timeout=120,
                              cwd=tmp_path)
    return _run


def test_console_script_main_path(run, tmp_path):
    (tmp_path / "doc.txt").write_text("Marrow Bay has 3 piers.\n")
    (tmp_path / "q.jsonl").write_text('{"question": "How many piers?", "id": "piers"}\n')
    ingest = run("ingest", "doc.txt", "q.jsonl", "--json")
    assert ingest.returncode == 0, ingest.stderr
    assert json.loads(ingest.stdout)["job"] == 1 and "queued job 1" in ingest.stderr
    status = run("status", "--json")
    assert json.loads(status.stdout)["totals"]["jobs"]["queued"] == 1
    exported = run("export", "out.csv", "--all")
    assert exported.returncode == 0 and exported.stdout == ""
    with open(tmp_path / "out.csv", encoding="utf-8-sig", newline="") as f:
        assert [r["question_id"] for r in csv.DictReader(f)] == ["piers"]
    missing = run("ingest", "nope.txt", "q.jsonl")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == "error: nope.txt: no such document\n"
    # The same through `python -m ppqa` and the --db option instead of PPQA_DB.
    module = subprocess.run([sys.executable, "-m", "ppqa", "--db", str(tmp_path / "sub.db"),
                             "jobs", "--json"], capture_output=True, text=True, timeout=120)
    assert [j["job"] for j in json.loads(module.stdout)] == [1]


def test_no_color_is_honoured(run, tmp_path):
    (tmp_path / "doc.txt").write_text("Text.\n")
    (tmp_path / "q.txt").write_text("Question?\n")
    run("ingest", "doc.txt", "q.txt")
    coloured = run("jobs", extra_env={"FORCE_COLOR": "1"})
    assert COLOR.search(coloured.stdout), "expected colour when forced (the test's premise)"
    plain = run("jobs", extra_env={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert plain.returncode == 0 and "queued" in plain.stdout
    assert not COLOR.search(plain.stdout)


def test_store_commands_do_not_import_torch(tmp_path):
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from ppqa.cli.app import app\n"
        "from ppqa.store.db import open_db\n"
        f"open_db({str(tmp_path / 'p.db')!r}).close()\n"
        f"r = CliRunner().invoke(app, ['--db', {str(tmp_path / 'p.db')!r}, 'status', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'ppqa.engine') if m in sys.modules]\n"
        "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
