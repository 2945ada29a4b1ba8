"""A decode step at tensor_parallel N against one GPU: the cost and the gain of the split.

For each `--tp` value the engine is built over that many GPUs (`engine/parallel/launch.py`;
1: one GPU, no collectives), a document is prefilled once, and then `--questions` questions are
answered in each `--modes` mode with `--tokens` answer tokens each (EOS ignored), twice (the
first warms the graphs); the second run's decode seconds per answer token of one stream is the
step time reported, with prefill time apart. JSON on stdout and in `--out`.

    NCCL_NVLS_ENABLE=0 python3 benchmarks/tp_decode.py --model dummy:qwen2.5-7b --tp 1,2 \
        --questions 64 --doc-tokens 8192 --tokens 128 --out tp_decode.json

Each rank allocates its own KV pool (`--mem-fraction` of what its weights leave free), so the
split also doubles the KV room; the step time here is for the same batch at every N.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

from ppqa.engine.parallel.launch import keep_multicast_off


def _engine(model: str, world: int, device: str, mem_fraction: float):
    from ppqa.config import EngineConfig
    from ppqa.engine.engine import Engine
    from ppqa.engine.parallel.launch import start_engine

    devices = [f"cuda:{i}" if device == "cuda" else device for i in range(world)]
    if world == 1:
        return Engine(model, device=devices[0],
                      config=EngineConfig(mem_fraction=mem_fraction)), None
    return start_engine(model, devices, mem_fraction=mem_fraction)


def measure(args, world: int) -> dict:
    from ppqa import QuestionRequest, SamplingParams

    began = time.perf_counter()
    engine, ranks = _engine(args.model, world, args.device, args.mem_fraction)
    built = time.perf_counter() - began
    if engine.device.type == "cuda":
        engine.warmup()
    # dummy:<preset> reads bytes: one token per character.
    document = ("the harbor opened early and the ferry left at noon " * args.doc_tokens)[
        :args.doc_tokens]
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    requests = [QuestionRequest(i, document, f"What is said about item {i}?", sampling)
                for i in range(args.questions)]
    rows = {}
    try:
        for mode in args.modes:
            for _ in range(2):  # the second run is timed: graphs captured, document cached
                stats = engine.run(requests, mode=mode,
                                   streams=args.streams if mode == "parallel" else None)
            rows[mode] = {"wall_s": stats.wall_s, "decode_s": stats.decode_s,
                          "prefill_s": stats.prefill_s, "answer_tokens": stats.answer_tokens,
                          "step_ms": 1000 * stats.decode_s / args.tokens,
                          "tokens_per_s": stats.answer_tokens / stats.wall_s,
                          "peak_memory_gib": engine.peak_memory_bytes / 2**30}
    finally:
        if ranks is not None:
            ranks.close()
    return {"tensor_parallel": world, "build_s": built, "kv_tokens": engine.kv_capacity,
            "modes": rows}


def _measured(args, world: int, send) -> None:
    send.send(measure(args, world))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:qwen2.5-7b")
    parser.add_argument("--tp", default="1,2", help="tensor_parallel values, e.g. 1,2")
    parser.add_argument("--modes", default="stock,cascade")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--mem-fraction", type=float, default=0.5)
    parser.add_argument("--device", default="cuda", help="cuda (rank r on cuda:r) or cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    keep_multicast_off()
    results = {"model": args.model, "questions": args.questions, "doc_tokens": args.doc_tokens,
               "tokens": args.tokens, "runs": []}
    context = multiprocessing.get_context("spawn")
    for world in (int(n) for n in args.tp.split(",")):
        # Each N in a process of its own (one torch.distributed group per process life; not a
        # Pool, whose daemonic workers may not start the other ranks).
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_measured, args=(args, world, send))
        process.start()
        results["runs"].append(receive.recv())
        process.join()
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
