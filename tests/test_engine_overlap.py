"""One decode step in flight (`EngineConfig.overlap_steps`, on by default): the engine builds and
launches step t+1 before it reads step t's tokens, so a stream that step t ended is fed once more.

The answers must not change: greedy and seeded sampled answers, with streams ending by EOS, stop
strings and budgets of 1 to 6 tokens, in every mode and with several documents and a pool small
enough that requests wait, equal those of a run that reads every step back before the next; and
every KV slot and table row comes back afterwards.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from ppqa import QuestionRequest, SamplingParams
from tests.test_engine_api import plain_template, text, tiny_engine


def workload(rng: random.Random, tmpl: str) -> list[QuestionRequest]:
    docs = [text(rng, n) for n in (150, 60)]
    requests = []
    for d, doc in enumerate(docs):
        for q in range(9):
            stop = ("e",) if q % 4 == 1 else ()  # a common letter: some answers stop on it
            sp = SamplingParams(max_new_tokens=rng.randint(1, 6), stop=stop,
                                temperature=0.9 if q % 3 == 0 else 0.0, seed=100 * d + q)
            requests.append(QuestionRequest((d, q), doc, text(rng, rng.randint(2, 12)), sp, tmpl))
    return requests


def run(eng, requests, **kwargs) -> dict:
    got = {}
    eng.run(requests, on_answer=lambda r, a: got.__setitem__(r.key, a), **kwargs)
    assert len(got) == len(requests)
    return {k: (a.token_ids, a.finish_reason, a.text) for k, a in got.items()}


@pytest.mark.parametrize("mode,streams", [("stock", None), ("cascade", None), ("parallel", 4)])
def test_step_in_flight_gives_the_answers_of_step_by_step(mode: str, streams, tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    requests = workload(random.Random(mode), tmpl)
    # A pool of ~2 documents' worth: requests wait for others to finish (admission drains).
    engines = {overlap: tiny_engine("tiny-gqa", seed=3, overlap_steps=overlap, kv_token_budget=700)
               for overlap in (True, False)}
    probe = run(engines[False], [QuestionRequest(r.key, r.document, r.question,
                                                 SamplingParams(max_new_tokens=8, ignore_eos=True), tmpl)
                                 for r in requests], mode="stock")
    early = collections.Counter(t for ids, _, _ in probe.values() for t in set(ids[1:4]))
    eos = next(t for t, n in early.most_common() if n < len(probe))  # ends some answers early
    for eng in engines.values():
        eng.tokenizer.eos_token_ids = [eos]
    reference = run(engines[False], requests, mode=mode, streams=streams)
    overlapped = run(engines[True], requests, mode=mode, streams=streams)
    assert overlapped == reference
    reasons = {reason for _, reason, _ in reference.values()}
    assert reasons == {"stop", "length"}, reasons  # both ways of ending, mid-batch
    parts = engines[True]._parts
    cached = sum(len(d.token_ids) for d in parts.docs._docs.values())
    assert parts.pool.allocator.num_free == parts.pool.allocator.capacity - cached
    assert parts.table.num_free_rows == engines[True].config.max_batch_requests
    assert parts.docs._docs and all(d.ref_count == 0 for d in parts.docs._docs.values())


def test_overlap_steps_is_on_by_default() -> None:
    assert tiny_engine("tiny-gqa").config.overlap_steps is True
