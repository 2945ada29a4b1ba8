"""N samples per question: each question's samples are streams of their own with seeds derived
from the question's seed and the sample index. They differ from each other, come out the same
in every mode and batch, reproduce with the same seed, and sample 0 is the one-sample answer.
Tiny random models, plain template (one byte a token)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppqa import QuestionRequest, SamplingParams
from ppqa.config import sample_seed
from tests.helpers import assert_pool_holds_only_cached_documents, plain_template, text, tiny_engine

N = 5


def requests(tmpl: str, seed: int, samples: int = N) -> list[QuestionRequest]:
    rng = random.Random("samples")
    docs = [text(rng, 90), text(rng, 30)]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=seed,
                              ignore_eos=True)
    return [QuestionRequest((d, q), doc, text(rng, rng.randint(3, 12)), sampling, tmpl,
                            samples=samples)
            for d, doc in enumerate(docs) for q in range(3)]


def run(engine, reqs, **kwargs) -> dict:
    """(request key, sample) -> token ids, every sample of every question answered."""
    got = {}

    def keep(req, answer):
        assert (req.key, answer.sample) not in got
        got[(req.key, answer.sample)] = answer.token_ids

    engine.run(reqs, on_answer=keep, **kwargs)
    assert len(got) == sum(r.samples for r in reqs)
    return got


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-odd"])
def test_samples_differ_and_every_mode_gives_the_same(preset: str, tmp_path: Path) -> None:
    engine = tiny_engine(preset)
    tmpl = plain_template(tmp_path)
    stock = run(engine, requests(tmpl, seed=7), mode="stock")
    for req in requests(tmpl, seed=7):
        drawn = {tuple(stock[(req.key, i)]) for i in range(N)}
        assert len(drawn) > 1, "the samples of a question all came out the same"
    for mode, streams in (("parallel", 4), ("parallel", 16), ("cascade", None), ("auto", None)):
        assert run(engine, requests(tmpl, seed=7), mode=mode, streams=streams) == stock, mode
    assert_pool_holds_only_cached_documents(engine)


def test_parallel_forwards_a_sampled_question_once(tmp_path: Path) -> None:
    """In parallel, a question's samples share its tokens in their row (as a document is
    shared); stock forwards the question once per sample."""
    tmpl = plain_template(tmp_path)
    reqs = requests(tmpl, seed=5)
    prefilled = {}
    for mode in ("stock", "parallel"):
        engine = tiny_engine("tiny-gqa")
        prefilled[mode] = engine.run(reqs, mode=mode, streams=N).prefilled_tokens
    question_tokens = 0  # as the engine tokenizes them: after the questions' common opening
    for doc in dict.fromkeys(r.document for r in reqs):
        asked = [r.question for r in reqs if r.document == doc]
        prompt = engine.tokenizer.prompt(tmpl, doc, asked).with_common_opening()
        question_tokens += sum(map(len, prompt.suffix_ids))
    assert prefilled["stock"] - prefilled["parallel"] == (N - 1) * question_tokens


def test_samples_reproduce_and_sample_zero_is_the_single_answer(tmp_path: Path) -> None:
    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    first = run(engine, requests(tmpl, seed=11), mode="parallel")
    assert run(tiny_engine("tiny-gqa"), requests(tmpl, seed=11), mode="parallel") == first
    other = run(engine, requests(tmpl, seed=12), mode="parallel")
    assert other != first
    single = run(engine, requests(tmpl, seed=11, samples=1), mode="stock")
    assert {k: v for k, v in first.items() if k[1] == 0} == single
    # A question asked for more samples keeps the ones it had.
    more = run(engine, requests(tmpl, seed=11, samples=N + 2), mode="stock")
    assert {k: v for k, v in more.items() if k[1] < N} == first


def test_sample_seeds_are_distinct_and_fixed() -> None:
    seeds = [sample_seed(123, i) for i in range(64)]
    assert seeds[0] == 123 and len(set(seeds)) == 64
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sample_seed(123, i) for i in range(64)]
    assert sample_seed(124, 1) != sample_seed(123, 1)


def test_samples_are_refused_where_they_mean_nothing() -> None:
    hot = SamplingParams(temperature=0.8)
    with pytest.raises(ValueError, match="3 samples need a temperature above 0"):
        QuestionRequest(0, "doc", "q", samples=3)
    with pytest.raises(ValueError, match="2 samples need a temperature above 0"):
        QuestionRequest(0, "doc", "q", choices=("a", "b"), samples=2)
    # Choices at a temperature: drawn from their scores (tests/test_choices_samples.py).
    assert QuestionRequest(0, "doc", "q", hot, choices=("a", "b"), samples=2).samples == 2
    with pytest.raises(ValueError, match="samples must be an integer >= 1"):
        QuestionRequest(0, "doc", "q", hot, samples=0)
    QuestionRequest(0, "doc", "q", samples=1)  # one greedy answer is the usual case
