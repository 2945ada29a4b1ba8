"""The floor (ppqa/bench/floor.py) of the workloads in e2e results JSONs measured before
`ppqa bench --e2e` recorded it: each workload drawn again from its seed with its model's
tokenizer, as many documents as the run had, and every mode's mean run over that floor.

    python3 benchmarks/e2e_floor.py benchmarks/results/h200/e2e_quality_s23c5.json ...
"""

from __future__ import annotations

import argparse
import json

from ppqa.bench.floor import floor_seconds, workload_documents
from ppqa.bench.workloads import get_workload, make_jobs
from ppqa.config import EngineConfig
from ppqa.engine.loading.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="e2e results JSONs")
    args = ap.parse_args()
    print("| results | workload | floor s (prefill + decode) | mode | run s | run / floor |")
    print("|---|---|---|---|---|---|")
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        for w in data["workloads"]:
            info = w["workload"]
            floor = info.get("floor")
            if floor is None:  # measured before the e2e bench recorded it: draw it again
                loaded = load_model(w["model"])
                jobs = make_jobs(get_workload(info["name"]), loaded.tokenizer,
                                 info["documents"])
                floor = floor_seconds(loaded.config, workload_documents(jobs, loaded.tokenizer),
                                      max_batch=EngineConfig().max_batch_requests)
            for mode, s in w["summary"].items():
                run = s.get("run_s")
                print(f"| {path.rsplit('/', 1)[-1]} | {info['name']} | {floor['total_s']:.2f} "
                      f"({floor['prefill_s']:.2f} + {floor['decode_s']:.2f}) | {mode} | "
                      f"{run:.2f} | {run / floor['total_s']:.2f}x |")


if __name__ == "__main__":
    main()
