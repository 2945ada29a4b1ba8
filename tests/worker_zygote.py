"""A launcher of `ppqa run` worker processes for the fault tests (tests/test_faults*.py).

Started once per test session as `python tests/worker_zygote.py` (the `zygote` fixture,
tests/faults.py), it imports torch, the engine and the CLI and answers one question with the
tiny model (so that everything lazy is loaded), then forks a fresh process per request: each
child runs the real `ppqa` command line (store, lease thread, engine, signals) in its own
process, and can be killed with SIGKILL like any worker. Killing 50 workers then costs 50 forks instead of 50 interpreter starts of a few
seconds each on a loaded 2-core machine. Torch runs one thread, so no thread pool is forked.

Protocol, one line each way on stdin/stdout:
    run {"argv": [...], "env": {...}, "stdout": PATH, "stderr": PATH}  ->  PID
    reap PID                                                          ->  EXIT STATUS
(the status as `os.waitstatus_to_exitcode` gives it: -9 for a process killed by SIGKILL).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _warm_up() -> None:
    import tempfile

    import torch

    torch.set_num_threads(1)
    import ppqa.cli.app  # noqa: F401 - the command line and its commands
    import ppqa.cli.run_progress  # noqa: F401
    import ppqa.worker.loop  # noqa: F401 - the worker and the store's queue
    from ppqa.store.db import open_db
    from ppqa.worker.setup import load_engine

    try:
        import sqlalchemy.dialects.postgresql.psycopg  # noqa: F401
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as folder:  # SQLAlchemy's SQLite dialect, migrations
        open_db(f"{folder}/warm.db").close()
    load_engine("dummy:tiny-mha", "cpu").answer("A warm-up document.", ["Why?"], mode="stock")


def _child(spec: dict) -> None:
    """Become a `ppqa` process: fresh stdio, the given environment, then the CLI."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, like a worker started from a shell
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, spec["stdout"]), (2, spec["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
        os.environ.update(spec.get("env", {}))
        from ppqa.cli.app import app

        app(args=spec["argv"], prog_name="ppqa")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it like the interpreter would, then exit
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def main() -> None:
    _warm_up()
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "run":
            pid = os.fork()
            if pid == 0:
                _child(json.loads(argument))
            print(pid, flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(argument), 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
        else:
            print(f"unknown command {command!r}", flush=True)


if __name__ == "__main__":
    main()
