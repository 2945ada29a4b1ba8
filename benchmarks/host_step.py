"""Host time of a decode step, no GPU needed: the per-request cost behind host-bound cells.

cProfile of `Engine.answer` on a tiny model with many requests, per mode (NOTES.md, the
host-bound Qwen2.5-1.5B cell).

The model is tiny so that the per-step Python work (scheduler step building, sampling
parameters, postprocessing of sampled tokens) stands out; on a GPU the engine builds step t+1
while the device runs step t, so this work is hidden only while it is shorter than a step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_step.py [--questions 256] [--tokens 32]
"""

import argparse
import cProfile
import pstats

import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig

HOST_STEPS = ("decode_step", "prefill_step", "postprocess")  # decode_step builds sampling rows too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    eng = Engine("dummy:tiny-mha", device="cpu", config=EngineConfig(cuda_graphs=True))
    doc = "word " * 60
    questions = [f"question {i}?" for i in range(args.questions)]
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    eng.answer(doc, questions[:2], mode="stock", sampling=sampling)  # cache the document
    for mode in ("stock", "cascade", "parallel"):
        profile = cProfile.Profile()
        profile.enable()
        eng.answer(doc, questions, mode=mode, sampling=sampling)
        profile.disable()
        for (path, _, name), row in pstats.Stats(profile).stats.items():
            if name in HOST_STEPS and path.endswith("scheduler.py"):
                print(f"{mode:8s} {name:15s} {1000 * row[3] / row[1]:6.2f} ms a call ({row[1]} calls)")


if __name__ == "__main__":
    main()
