"""Suite-wide fixtures: an isolated PPQA_HOME for every test, and job-store databases.

`sqlite_db` / `pg_db` give an open, migrated store (SQLite file in tmp, or a fresh PostgreSQL
schema dropped afterwards); `any_db` runs a test on both; `pg_url` is the URL of a fresh schema
for tests that start their own processes. PostgreSQL tests need the server on
127.0.0.1:5432 (database `test`, trust auth; override with PPQA_TEST_PG) and are skipped, saying
how to run them, when it cannot be reached.
"""

import os

# Before anything imports triton: kernels run in Triton's interpreter on machines without an
# NVIDIA GPU (this one, CI); on a GPU machine the same tests compile real kernels.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import uuid
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures_models", "tests.faults"]

PG_BASE_URL = os.environ.get("PPQA_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
_pg_problem: list[str] = []  # cached reachability verdict ("" = reachable)


@pytest.fixture(autouse=True)
def ppqa_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own PPQA_HOME and no PPQA_DB: the user's real store is never touched."""
    home = tmp_path / "ppqa-home"
    monkeypatch.setenv("PPQA_HOME", str(home))
    monkeypatch.delenv("PPQA_DB", raising=False)
    return home


def _pg_unreachable() -> str:
    if not _pg_problem:
        from sqlalchemy import create_engine, text

        try:
            engine = create_engine(PG_BASE_URL, connect_args={"connect_timeout": 3})
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            engine.dispose()
            _pg_problem.append("")
        except Exception as exc:  # any failure means: cannot run the PostgreSQL tests here
            _pg_problem.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return _pg_problem[0]


@pytest.fixture
def pg_url():
    """URL of a fresh, empty PostgreSQL schema (dropped after the test)."""
    problem = _pg_unreachable()
    if problem:
        pytest.skip(f"PostgreSQL not reachable at {PG_BASE_URL} ({problem}); start it with "
                    "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
                    "or point PPQA_TEST_PG at a server to run these tests")
    from sqlalchemy import create_engine, text

    schema = f"ppqa_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_BASE_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_BASE_URL else "?"
    try:
        yield f"{PG_BASE_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


def _opened(location):
    from ppqa.store.db import open_db

    db = open_db(location)
    yield db
    db.close()


@pytest.fixture
def sqlite_db(sqlite_path: Path):
    """An open, migrated SQLite store in a temporary file."""
    yield from _opened(sqlite_path)


@pytest.fixture
def pg_db(pg_url: str):
    """An open, migrated store in a fresh PostgreSQL schema."""
    yield from _opened(pg_url)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_location(request, sqlite_path: Path) -> str:
    """A store location (file path or URL) on SQLite and on PostgreSQL, not opened yet."""
    if request.param == "sqlite":
        return str(sqlite_path)
    return request.getfixturevalue("pg_url")


@pytest.fixture
def any_db(db_location: str):
    """An open, migrated store, once on SQLite and once on PostgreSQL."""
    yield from _opened(db_location)


@pytest.fixture
def add_job():
    """`add_job(db, document, questions, name=, priority=, **generation_params) -> job id`."""
    from ppqa.files.inputs import QuestionInput
    from ppqa.store.jobs import IngestRequest, ingest
    from ppqa.store.params import GenerationParams

    def _add(db, document: str = "A short document.", questions=("First?", "Second?"), *,
             name: str = "doc", priority: int = 0, **params) -> int:
        qs = [QuestionInput(str(i + 1), q, f"test:{i + 1}") for i, q in enumerate(questions)]
        request = IngestRequest(document, name, qs, GenerationParams(**params), priority)
        return ingest(db, [request], force=True)[0].job_id

    return _add
