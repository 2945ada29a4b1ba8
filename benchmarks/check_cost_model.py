"""How well the cost model behind mode="auto" (ppqa/engine/runtime/cost_model.py) agrees with
measured `ppqa bench` cells: for each cell, the mode the model picks against the mode that ran
fastest, and the predicted step speedups over stock beside the measured wall-time speedups.

    python benchmarks/check_cost_model.py                       # the H200 results RESULTS.md cites
    python benchmarks/check_cost_model.py benchmarks/results/h200/bench_qwen7b_8k64.json ...

Runs on the CPU in a second (no model is built): each cell's workload is rebuilt the way
`ppqa bench` built it (the seeded document, the qa template, the questions' common opening
joined to the document, as the engine does by default) and given to the model with the H200's
rates. The candidates are the measured ones among stock, cascade and parallel, so a cell that
timed all three is checked on all three (parallel predicted at the model's own P, not the cell's);
the engine's own auto on a GPU offers stock and cascade.
A pick within TIE of the fastest counts as agreement: closer than that, runs of one mode spread
as much (benchmarks/RESULTS.md). The model's constants are fitted to these cells; this script
says whether they still agree after a kernel or a constant changes. Exit status 1 when any cell
disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository's ppqa, when run from a checkout

from ppqa.bench.grid import make_workload  # noqa: E402
from ppqa.engine.loading.presets import preset_config  # noqa: E402
from ppqa.engine.runtime import cost_model as cm  # noqa: E402

MODES = ("stock", "cascade", "parallel")
TIE = 0.05  # a pick within 5% of the fastest measured mode agrees


def cell_workload(cell: dict) -> tuple[object, cm.Workload]:
    """The model config and the cost model's workload of one bench cell (its first seed)."""
    config, _, tokenizer = preset_config(cell["model"].removeprefix("dummy:"))
    document, questions = make_workload(tokenizer, cell["doc_tokens"], cell["questions"],
                                        cell["seeds"][0])
    prompt = tokenizer.prompt("qa", document, questions).with_common_opening()
    own = round(sum(map(len, prompt.suffix_ids)) / len(questions))
    return config, cm.Workload(len(prompt.prefix_ids), len(questions), own,
                               cell["max_new_tokens"])


def check(cell: dict) -> tuple[bool, str] | None:
    walls = {m: sum(v) / len(v) for m, v in cell["wall_s"].items() if m in MODES and v}
    if "stock" not in walls or len(walls) < 2:
        return None
    config, work = cell_workload(cell)
    candidates = tuple(m for m in MODES if m in walls)
    picked, streams, predicted = cm.choose(config, work, cm.DeviceRates.for_device("cuda"),
                                           candidates)
    fastest = min(walls, key=walls.get)
    agrees = walls[picked] <= (1 + TIE) * walls[fastest]
    ratios = "  ".join(f"{m} {walls['stock'] / walls[m]:5.2f}x/{predicted['stock'] / predicted[m]:5.2f}x"
                       for m in candidates if m != "stock")
    line = (f"{cell['model'].removeprefix('dummy:'):13s} {cell['doc_tokens']:>6} {cell['questions']:>4} "
            f"{cell['max_new_tokens']:>5}  picks {picked:8s} fastest {fastest:8s} "
            f"{'agree' if agrees else 'DISAGREE':8s} measured/predicted: {ratios}")
    return agrees, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="ppqa bench JSON files (default: results/h200/bench_*.json)")
    args = parser.parse_args(argv)
    files = args.files or sorted((HERE / "results" / "h200").glob("bench_*.json"))
    print(f"{'model':13s} {'doc':>6} {'Q':>4} {'answ':>5}  (speedups over stock: measured wall / "
          "predicted step)")
    results = []
    for path in files:
        for cell in json.loads(path.read_text())["cells"]:
            checked = check(cell)
            if checked is not None:
                results.append(checked[0])
                print(f"{checked[1]}  [{path.name}]")
    agreed = sum(results)
    print(f"{agreed} of {len(results)} cells agree (a pick within {TIE:.0%} of the fastest)")
    return 0 if agreed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
