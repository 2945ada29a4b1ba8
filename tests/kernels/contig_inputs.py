"""Contiguous documents for the kernel tests: the engine's allocator hands a document one run of
slots, while the questions and answers around it stay scattered.

`Pool.take` (kernel_inputs.py) hands out slots from a shuffled free list; `plan_takes` reorders
that list so the next takes get consecutive slots where asked, then the kernels can be given
doc_start/doc_len (extend) or doc_starts (shared prefix) for those runs. `junk_document` overwrites
a row's document entries in req_to_token, so a test proves that a contiguous path never reads them.
"""

from __future__ import annotations

import torch


def plan_takes(pool, takes: list[tuple[int, bool]], gen: torch.Generator) -> list[int]:
    """Reorders pool.free so that its next takes, of sizes n in order, get one ascending run of
    slots where contiguous is True and scattered slots otherwise; later takes get scattered
    slots. Returns the first slot of each contiguous run, in order."""
    free = sorted(pool.free)
    run_total = sum(n for n, contiguous in takes if contiguous)
    gap = 3  # junk slots between runs, so a read past a run's end gets wrong keys
    offset = int(torch.randint(0, max(1, len(free) - run_total - gap * len(takes)), (1,),
                               generator=gen))
    runs, pos = [], offset
    for n, contiguous in takes:
        if contiguous:
            runs.append(free[pos: pos + n])
            assert len(runs[-1]) == n and free[pos + n - 1] - free[pos] == n - 1, "pool too small"
            pos += n + gap
    taken = {s for run in runs for s in run}
    rest = [s for s in free if s not in taken]
    rest = [rest[i] for i in torch.randperm(len(rest), generator=gen).tolist()]
    ordered, run_iter = [], iter(runs)
    for n, contiguous in takes:
        if contiguous:
            ordered += next(run_iter)
        else:
            ordered, rest = ordered + rest[:n], rest[n:]
    pool.free = ordered + rest
    return [run[0] for run in runs]


def junk_document(req_to_token: torch.Tensor, rows, doc_lens) -> torch.Tensor:
    """A copy of the table whose entries [0, doc_len) of each listed row point at the sink
    slot (0), whose stream id hides it from every query of the gather path."""
    junk = req_to_token.clone()
    for row, n in zip(rows, doc_lens):
        junk[row, :n] = 0
    return junk
