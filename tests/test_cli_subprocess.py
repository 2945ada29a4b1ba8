"""The installed `ppqa` console script in real processes: the main path end to end (ingest, run
on a tiny model, export: the engine's own answers), exit codes, stdout/stderr separation,
NO_COLOR, and that the store commands never import torch."""

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


def test_ingest_run_export_gives_the_engines_answers(run, tmp_path):
    """The whole path in real processes on a real SQLite file: `ppqa ingest` -> `ppqa run
    --once` on a tiny random model on the CPU -> `ppqa export` JSONL. The exported answers are
    the ones `Engine.answer` gives for the same document, questions, template, greedy sampling,
    mode and model (the dummy preset's weights come from the engine's seed, the same here)."""
    from ppqa import Engine, SamplingParams

    document = ("The harbor of Velm opened in 1901. It has three piers, a red lighthouse and a "
                "ferry that leaves every hour. The harbor master is Ada Rook.\n")
    questions = {"opened": "When did the harbor open?", "piers": "How many piers are there?",
                 "master": "Who is the harbor master?", "ferry": "How often does the ferry go?"}
    (tmp_path / "doc.txt").write_text(document, encoding="utf-8")
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"question": q, "id": key}) + "\n"
                                              for key, q in questions.items()), encoding="utf-8")
    ingest = run("ingest", "doc.txt", "q.jsonl", "--name", "velm", "--template", "qa",
                 "--mode", "parallel", "--max-new-tokens", "6")
    assert ingest.returncode == 0, ingest.stderr
    worker = run("run", "--once", "--json", "--device", "cpu", "--model", "dummy:tiny-mha")
    assert worker.returncode == 0, worker.stderr
    assert json.loads(worker.stdout)["jobs_done"] == 1
    exported = run("export", "answers.jsonl")
    assert exported.returncode == 0, exported.stderr
    rows = [json.loads(line) for line in
            (tmp_path / "answers.jsonl").read_text(encoding="utf-8").splitlines()]

    expected = Engine("dummy:tiny-mha", device="cpu").answer(
        document, list(questions.values()), mode="parallel", template="qa",
        sampling=SamplingParams(max_new_tokens=6, temperature=0.0, seed=0))
    assert [r["question_id"] for r in rows] == list(questions)
    assert [r["question"] for r in rows] == list(questions.values())
    assert [r["answer"] for r in rows] == [a.text for a in expected]
    assert [(r["tokens"], r["finish_reason"]) for r in rows] == \
        [(len(a.token_ids), a.finish_reason) for a in expected]
    assert {(r["job"], r["document"], r["model"], r["mode"]) for r in rows} == \
        {(1, "velm", "dummy:tiny-mha", "parallel")}


HEAVY = ("torch", "transformers", "triton", "ppqa.engine")


def test_ingest_status_and_export_do_not_import_torch(tmp_path):
    """The store commands run the CLI in one process, one after another; after each, none of the
    engine's packages has been imported (they take seconds to import, and a queue host may not
    have them working)."""
    (tmp_path / "doc.txt").write_text("Marrow Bay has 3 piers.\n")
    (tmp_path / "q.txt").write_text("How many piers?\nWho runs the ferry?\n")
    db = str(tmp_path / "p.db")
    commands = [["ingest", "doc.txt", "q.txt", "--template", "judge"], ["status", "--json"],
                ["export", "out.jsonl", "--all"], ["export", "out.csv", "--all"]]
    probe = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from ppqa.cli.app import app\n"
        f"for args in {commands!r}:\n"
        f"    r = CliRunner().invoke(app, ['--db', {db!r}, *args])\n"
        "    assert r.exit_code == 0, (args, r.output)\n"
        f"    print(json.dumps([args[0], [m for m in {HEAVY!r} if m in sys.modules]]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines == [[args[0], []] for args in commands]
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 2  # the two questions, unanswered


@pytest.mark.parametrize("argv, code, out", [
    (["--help"], 0, "Usage"),  # click ends with SystemExit(0)
    (["no-such-command"], 2, "No such command"),  # a usage error
])
def test_a_process_with_torch_loaded_exits_with_its_code_after_its_atexit_handlers(
        argv, code, out, tmp_path):
    # With torch imported, `main` skips the interpreter's teardown (cli/app._exit): the exit
    # code, the output and the atexit handlers must be what a plain exit gives.
    program = ("import atexit, sys, torch\n"
               "from ppqa.cli.app import main\n"
               "atexit.register(lambda: print('atexit ran', flush=True))\n"
               f"sys.argv = ['ppqa', *{argv!r}]\n"
               "main()\n"
               "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert out in done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("atexit ran") and "not reached" not in done.stdout


def test_exit_with_a_message_prints_it_and_means_1_and_without_torch_raises():
    done = subprocess.run([sys.executable, "-c",
                           "import torch\nfrom ppqa.cli.app import _exit\n_exit('bad input')"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (1, "bad input")
    # Without torch (the store commands) it is a plain SystemExit, catchable as ever.
    done = subprocess.run([sys.executable, "-c",
                           "import sys\nfrom ppqa.cli.app import _exit\n"
                           "try:\n    _exit(3)\nexcept SystemExit as e:\n"
                           "    print('raised', e.code, 'torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "raised 3 False", done.stderr


def test_exit_with_an_idle_executor_alive_ends(tmp_path):
    """A thread pool left idle (the grammar masks' one, after a JSON-schema job) must not keep
    the process from ending: `ppqa run --once` hung after its summary line."""
    program = ("import torch\nfrom concurrent.futures import ThreadPoolExecutor\n"
               "pool = ThreadPoolExecutor(1)\npool.submit(lambda: 1).result()\n"
               "import threading\nended = threading.Thread(target=lambda: print('joined'))\n"
               "ended.start()\n"
               "from ppqa.cli.app import _exit\n_exit(4)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 4 and "joined" in done.stdout, done.stderr
