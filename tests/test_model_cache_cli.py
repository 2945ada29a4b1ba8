"""`ppqa models pull` / `ppqa models list` through Typer's CliRunner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from ppqa.cli.models import app


def test_models_module_does_not_import_torch():
    import subprocess

    code = "import sys, ppqa.cli.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def test_list_json_before_and_after_pull(smollm2_gguf, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {r["name"]: r for r in data["models"]}
    assert rows["smollm2"]["cached"] is False and data["models_dir"].endswith("models")
    assert {"dummy:codellama-7b", "dummy:qwen2.5-7b", "dummy:tiny-gqa"} <= set(rows)

    # Pulling while the shared test copy is linked in: verified and reported without fetching.
    from ppqa.engine.loading import model_cache

    target = model_cache.embedded_path("smollm2")
    target.parent.mkdir(parents=True)
    target.symlink_to(smollm2_gguf)
    result = runner.invoke(app, ["pull", "smollm2"])
    assert result.exit_code == 0 and result.stdout.strip() == str(target)
    rows = {r["name"]: r for r in json.loads(runner.invoke(app, ["list", "--json"]).stdout)["models"]}
    assert rows["smollm2"]["cached"] is True and rows["smollm2"]["path"] == str(target)


def test_list_table():
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0
    assert "smollm2" in result.stdout and "not cached" in result.stdout
    assert "dummy:tiny-odd" in result.stdout


def test_pull_errors(monkeypatch):
    runner = CliRunner()
    result = runner.invoke(app, ["pull", "gpt-5"])
    assert result.exit_code == 2 and "unknown embedded model 'gpt-5'" in result.stderr
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    result = runner.invoke(app, ["pull", "smollm2"])
    assert result.exit_code == 1
    assert "fetching smollm2" in result.stderr and "ppqa models pull smollm2" in result.stderr
