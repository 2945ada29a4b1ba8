"""One decode step in flight (`EngineConfig.overlap_steps`, on by default): the engine builds and
launches step t+1 before it reads step t's tokens, so a stream that step t ended is fed once more.

The answers must not change: greedy and seeded sampled answers, with streams ending by EOS, stop
strings and budgets of 1 to 6 tokens, in every mode and with several documents and a pool small
enough that requests wait, equal those of a run that reads every step back before the next; and
every KV slot and table row comes back afterwards. A session decoding width-1 and parallel
requests side by side must not build a step for a request that reading back the step before
has just finished.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from ppqa import QuestionRequest, SamplingParams
from tests.helpers import (answers_by_key, assert_pool_holds_only_cached_documents,
                           overlap_workload, plain_template, text, tiny_engine)


@pytest.mark.parametrize("mode,streams", [("stock", None), ("cascade", None), ("parallel", 4)])
def test_step_in_flight_gives_the_answers_of_step_by_step(mode: str, streams, tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    requests = overlap_workload(random.Random(mode), tmpl)
    # A pool of ~2 documents' worth: requests wait for others to finish (admission drains).
    engines = {overlap: tiny_engine("tiny-gqa", seed=3, overlap_steps=overlap, kv_token_budget=700)
               for overlap in (True, False)}
    eight_tokens = SamplingParams(max_new_tokens=8, ignore_eos=True)
    probe = answers_by_key(engines[False], [QuestionRequest(r.key, r.document, r.question,
                                                            eight_tokens, tmpl) for r in requests],
                           mode="stock")
    early = collections.Counter(t for ids, _, _ in probe.values() for t in set(ids[1:4]))
    eos = next(t for t, n in early.most_common() if n < len(probe))  # ends some answers early
    for eng in engines.values():
        eng.tokenizer.eos_token_ids = [eos]
    reference = answers_by_key(engines[False], requests, mode=mode, streams=streams)
    overlapped = answers_by_key(engines[True], requests, mode=mode, streams=streams)
    assert overlapped == reference
    reasons = {reason for _, reason, _ in reference.values()}
    assert reasons == {"stop", "length"}, reasons  # both ways of ending, mid-batch
    assert_pool_holds_only_cached_documents(engines[True])
    assert len(engines[True].parts.docs) == 2  # both documents stay cached


def test_overlap_steps_is_on_by_default() -> None:
    assert tiny_engine("tiny-gqa").config.overlap_steps is True


def test_a_request_finished_by_the_step_read_between_two_batches_is_not_built(
        tmp_path: Path) -> None:
    """One session decoding width-1 and parallel requests: each decode iteration runs a batch of
    each, and launching the first reads back the step in flight, which may end parallel
    requests (stop strings) that the second batch was planned with."""
    tmpl = plain_template(tmp_path)
    rng = random.Random(0)
    requests = []
    for d in range(2):
        doc = text(rng, 100)
        requests += [QuestionRequest((d, q), doc, text(rng, 10), SamplingParams(
            max_new_tokens=30, stop=("a",)), tmpl) for q in range(8)]
    runs = {}
    for overlap in (True, False):
        eng = tiny_engine(overlap_steps=overlap)
        got = {}
        session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
        session.submit(requests[:8], mode="stock")
        session.submit(requests[8:], mode="parallel", streams=2)
        session.drain()
        session.flush()
        session.close()
        runs[overlap] = {k: (a.token_ids, a.finish_reason) for k, a in got.items()}
        assert_pool_holds_only_cached_documents(eng)
    assert runs[True] == runs[False] and len(runs[True]) == len(requests)
    assert {reason for _, reason in runs[True].values()} == {"stop", "length"}
