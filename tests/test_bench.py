"""ppqa bench: the workload is exact and seeded, the summary maths is right, and a tiny run works."""

import json
import math

import pytest

from ppqa.bench import grid as b


def test_workload_has_exact_token_count_and_is_seeded():
    from ppqa.engine.loading.tokenizer import ByteTokenizer

    tok = ByteTokenizer(vocab_size=384)
    doc, qs = b.make_workload(tok, 1000, 5, seed=3)
    assert len(tok.encode(doc)) == 1000
    assert qs[4] == "Summarize the main point of paragraph 5."
    assert b.make_workload(tok, 1000, 5, seed=3)[0] == doc
    assert b.make_workload(tok, 1000, 5, seed=4)[0] != doc


def test_speedup_is_geometric_mean_of_per_seed_ratios():
    cell = b.Cell(model="m", doc_tokens=1, questions=1, max_new_tokens=1, seeds=[0, 1], streams=4,
                  wall_s={"stock": [8.0, 2.0], "parallel": [2.0, 1.0]})
    cell.summarize()
    assert cell.speedups["parallel"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert cell.to_json()["speedup_parallel_vs_stock"] == pytest.approx(math.sqrt(8.0))
    table = b.markdown_table([cell.to_json()])
    assert "| m | 1 | 1 | 1 | 5.00 | 1.50 | 2.83 |" in table


def test_tiny_bench_runs_every_mode_and_writes_json(tmp_path):
    from typer.testing import CliRunner

    from ppqa.cli.app import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", "dummy:tiny-gqa", "--device", "cpu", "--doc-tokens", "48",
        "--questions", "3", "--max-new-tokens", "3", "--seeds", "0", "--streams", "2",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (cell,) = data["cells"]
    assert set(cell["wall_s"]) == {"stock", "cascade", "parallel", "auto"}
    assert len(cell["runs"]) == 2 * 4  # two passes, four modes, one seed
    assert cell["runs"][3]["mode"] == "auto" and cell["runs"][4]["mode"] == "auto"  # reversed
    # Each mode's wall is the mean of its passes; its speedup is stock's wall over its own.
    for mode, (wall,) in cell["wall_s"].items():
        passes = [r["wall_s"] for r in cell["runs"] if r["mode"] == mode]
        assert len(passes) == 2 and wall == pytest.approx(sum(passes) / 2)
    assert set(cell["speedups"]) == {"cascade", "parallel", "auto"}
    for mode, speedup in cell["speedups"].items():
        assert speedup == pytest.approx(cell["wall_s"]["stock"][0] / cell["wall_s"][mode][0])
        assert cell[f"speedup_{mode}_vs_stock"] == speedup
    assert cell["chosen"]["0"] == f"{cell['runs'][3]['resolved']}/P={cell['runs'][3]['streams']}"
    assert set(cell["warmup_s"]) == {"stock", "cascade", "parallel", "auto"}
    again = CliRunner().invoke(app, ["bench", "--from", str(out)])
    assert again.exit_code == 0 and "tiny-gqa" in again.output


def test_bench_refuses_bad_modes():
    from typer.testing import CliRunner

    from ppqa.cli.app import app

    result = CliRunner().invoke(app, ["bench", "--modes", "parallel,fast", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--modes" in result.output


def test_bench_flashinfer_baseline_needs_a_gpu():
    from typer.testing import CliRunner

    from ppqa.cli.app import app

    result = CliRunner().invoke(app, ["bench", "--model", "dummy:tiny-hd128", "--device", "cpu",
                                      "--modes", "stock,stock-flashinfer", "--doc-tokens", "32",
                                      "--questions", "2", "--max-new-tokens", "2"])
    assert result.exit_code == 2
    assert "needs a CUDA device" in result.output
