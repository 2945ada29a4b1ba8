"""The ranks of the tensor-parallel tests (tests/test_tensor_parallel.py), one process each.

`run_rank(rank, world, port, out_dir, requests, on_gpus)` joins a group on 127.0.0.1 (gloo on the
CPU; NCCL with rank r on cuda:r, in fp32, for tests/gpu), builds the tiny GQA engine with
`tensor_parallel=world`, and then rank 0 answers `requests` in every mode,
and once more in a session that cancels a third of them after three steps, while the other
ranks `follow()`; last, every rank tries to build dummy:tiny-odd at the same tensor_parallel and
notes the refusal. Each rank writes what it saw to `out_dir/rank<r>.pkl` for the test to check.
`run_triton_rank` is a short run of the same split through the Triton backend (on the CPU under
Triton's interpreter, tests/kernels).
A module of its own because torch.multiprocessing's spawn imports the entry point by name.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

MODES = (("stock", None), ("parallel", 4), ("cascade", None), ("auto", None))
ENGINE_CONFIG = {"seed": 3, "kv_token_budget": 700}  # requests wait for KV: admission drains


def cancelled(key) -> bool:
    return key[1] % 3 == 0


def run_rank(rank: int, world: int, port: int, out_dir: str, requests: list,
             on_gpus: bool = False) -> None:
    import torch

    from ppqa import Engine, EngineConfig
    from ppqa.engine.parallel.launch import join_group, leave_group

    torch.set_num_threads(1)
    device = f"cuda:{rank}" if on_gpus else "cpu"
    join_group(rank, world, port, device, timeout=timedelta(seconds=120))
    seen: dict = {"rank": rank}
    try:
        engine = Engine("dummy:tiny-gqa", device=device, dtype="float32",
                        config=EngineConfig(tensor_parallel=world, **ENGINE_CONFIG))
        seen["graphs"] = engine.config.cuda_graphs
        seen["kv_heads"] = engine.parts.pool.kv.shape[3]
        seen["kv_slots"] = engine.parts.pool.num_slots
        if rank == 0:
            for mode, streams in MODES:
                got = {}
                engine.run(requests, mode=mode, streams=streams,
                           on_answer=lambda r, a: got.__setitem__(r.key, list(a.token_ids)))
                seen[mode] = got
            got = {}
            session = engine.session(lambda r, a: got.__setitem__(r.key, list(a.token_ids)))
            session.submit(requests, mode="stock")
            for _ in range(3):
                session.step()
            seen["dropped"] = session.cancel(lambda r: cancelled(r.key))
            session.drain()
            session.flush()
            session.close()
            seen["after_cancel"] = got
            seen["captured"] = engine.captured_graphs
            engine.shutdown()
            try:
                engine.answer("After the end.", ["Why?"])
            except RuntimeError as exc:
                seen["after_shutdown"] = str(exc)
        else:
            try:
                engine.session()
            except ValueError as exc:
                seen["session_refusal"] = str(exc)
            engine.follow()
            seen["followed"] = True
        seen["free_slots"] = engine.parts.pool.allocator.num_free
        seen["free_rows"] = engine.parts.table.num_free_rows
        try:
            Engine("dummy:tiny-odd", device=device, config=EngineConfig(tensor_parallel=world))
        except ValueError as exc:
            seen["odd_refusal"] = str(exc)
    finally:
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    leave_group()


TRITON_DOCUMENT = "The quick brown fox jumps over the lazy dog near the river bank. "
TRITON_QUESTIONS = ["What jumps?", "Who is lazy?"]


def run_triton_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch

    from ppqa import Engine, EngineConfig, SamplingParams
    from ppqa.engine.parallel.launch import join_group, leave_group

    torch.set_num_threads(1)
    join_group(rank, world, port, "cpu", timeout=timedelta(seconds=120))
    engine = Engine("dummy:tiny-gqa", device="cpu", dtype="float32",
                    config=EngineConfig(tensor_parallel=world, attention_backend="triton",
                                        kv_token_budget=4096))
    seen = {"backend": engine.config.attention_backend}
    if rank == 0:
        sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
        for mode in ("stock", "parallel", "cascade"):
            seen[mode] = [a.token_ids for a in engine.answer(
                TRITON_DOCUMENT, TRITON_QUESTIONS, mode=mode, sampling=sampling)]
        engine.shutdown()
    else:
        engine.follow()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(seen))
    leave_group()
