"""The wheel works outside the source tree: built from a copy of the package (pyproject.toml,
README.md, ppqa/), installed with `pip install --target` into a temporary folder, then run as
`python -m ppqa` from another folder with only that folder on PYTHONPATH. Every built-in
template queues a job there (the templates are package data, read with importlib.resources).
No network: the build uses the test environment's setuptools (`--no-build-isolation`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every built-in template of the source tree must reach the wheel.
TEMPLATES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "ppqa" / "templates")
                   .glob("*.jinja") if not p.name.startswith("_"))
assert {"judge", "label", "multiple_choice", "qa"} <= set(TEMPLATES)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder holding the installed wheel's `ppqa` (and its dist-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT / "ppqa", src / "ppqa",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(tmp / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp / "dist").glob("ppqa-*.whl")
    site = tmp / "site"
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return site


@pytest.fixture
def ppqa_from_wheel(installed: Path, tmp_path: Path, ppqa_home: Path):
    """Run `python -m ppqa ARGS` (or `python -c CODE`) importing only the installed wheel's
    ppqa, in a folder of its own."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PPQA_DB")}
    env.update(PYTHONPATH=str(installed), PPQA_HOME=str(ppqa_home))

    def run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
        command = ["-c", code] if code is not None else ["-m", "ppqa", *args]
        return subprocess.run([sys.executable, *command], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=120)

    return run, cwd


def test_the_wheel_holds_the_package_and_its_templates(installed: Path, ppqa_from_wheel):
    run, _ = ppqa_from_wheel
    probe = run(code="import json, ppqa; from ppqa.templates import list_templates; "
                     "print(json.dumps([ppqa.__file__, list_templates()]))")
    assert probe.returncode == 0, probe.stderr
    module, templates = json.loads(probe.stdout)
    assert Path(module).resolve().is_relative_to(installed.resolve())  # not the source tree
    assert templates == TEMPLATES
    assert sorted(p.stem for p in (ROOT / "ppqa" / "templates").glob("*.jinja")) == TEMPLATES
    assert sorted(p.name for p in (installed / "ppqa" / "templates").glob("*.jinja")) == \
        [f"{t}.jinja" for t in TEMPLATES]


def test_every_builtin_template_queues_a_job_from_the_wheel(ppqa_from_wheel, tmp_path: Path):
    run, cwd = ppqa_from_wheel
    (cwd / "doc.txt").write_text("The Orrin ferry leaves every hour from 7:00 to 19:00.\n")
    (cwd / "questions.txt").write_text("When does the first ferry leave?\nIs it hourly?\n")
    db = str(tmp_path / "jobs.db")
    for template in TEMPLATES:
        done = run("--db", db, "ingest", "doc.txt", "questions.txt", "--template", template)
        assert done.returncode == 0, (template, done.stderr)
    listed = run("--db", db, "jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    jobs = json.loads(listed.stdout)
    assert sorted(j["params"]["template"] for j in jobs) == TEMPLATES
    assert {(j["status"], j["questions"]) for j in jobs} == {("queued", 2)}
