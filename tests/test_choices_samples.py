"""Samples of a question with choices: drawn from its one scoring at the temperature.

The arithmetic of ppqa/choices.py (`draw_choices`: P(choice) proportional to exp(score / T), one
seeded uniform per sample; `vote`), then the engine: a question of N samples is scored once and
answered N times, the draws the same in every mode and for the same seed. The whole path
(ingest, worker, export) is tests/test_samples_choices_cli.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from ppqa import QuestionRequest, SamplingParams
from ppqa.choices import draw_choice, draw_choices, draw_probabilities, vote
from ppqa.config import sample_seed
from tests.helpers import plain_template, tiny_engine

PROBS = (0.5, 0.3, 0.2)
SCORES = [math.log(p) for p in PROBS]  # scores at temperature 1 give PROBS back


def frequencies(picks: list[int], choices: int) -> list[float]:
    counts = Counter(picks)
    return [counts[i] / len(picks) for i in range(choices)]


def test_the_same_seed_draws_the_same_and_each_sample_its_own() -> None:
    flat = [0.0] * 4
    first = draw_choices(flat, 1.0, seed=7, samples=64)
    assert draw_choices(flat, 1.0, seed=7, samples=64) == first
    assert draw_choices(flat, 1.0, seed=8, samples=64) != first
    # Sample s is seeded by sample_seed(seed, s) alone: a longer run keeps the first draws, and
    # one sample drawn on its own (a resumed job) is the one drawn among the others.
    assert draw_choices(flat, 1.0, seed=7, samples=80)[:64] == first
    assert [draw_choice([0.25] * 4, sample_seed(7, s)) for s in (0, 5, 63)] == [
        first[0], first[5], first[63]]
    # Different sample indices draw from different uniforms: 64 draws over 4 equal choices
    # use them all (a scheme that reused the seed would draw one choice 64 times).
    assert set(first) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draw_frequencies_follow_exp_score_over_temperature(temperature: float) -> None:
    """20,000 draws (seeded, so the same every run) within 0.015 of p_i^(1/T) / sum_j p_j^(1/T):
    at T = 0.5 that is (0.66, 0.24, 0.11), at T = 2 (0.42, 0.33, 0.26), far from PROBS and from
    each other, so a formula that scaled by T instead of 1/T, or ignored it, fails."""
    expected = [p ** (1 / temperature) for p in PROBS]
    expected = [e / sum(expected) for e in expected]
    assert draw_probabilities(SCORES, temperature) == pytest.approx(expected, rel=1e-12)
    got = frequencies(draw_choices(SCORES, temperature, seed=2026, samples=20_000), 3)
    assert got == pytest.approx(expected, abs=0.015)


def test_a_low_temperature_draws_the_best_choice_every_time() -> None:
    scores = [-1.0, -0.9, -1.2]  # close scores: at T = 1 each is drawn often
    assert len(set(draw_choices(scores, 1.0, seed=3, samples=200))) == 3
    assert set(draw_choices(scores, 1e-3, seed=3, samples=200)) == {1}
    # A very high temperature flattens the draws towards uniform.
    assert frequencies(draw_choices(scores, 1e4, seed=3, samples=6000), 3) == pytest.approx(
        [1 / 3] * 3, abs=0.03)


def test_drawing_needs_a_temperature_above_zero() -> None:
    with pytest.raises(ValueError, match="needs a temperature above 0, got 0"):
        draw_probabilities(SCORES, 0)


def records(*probs: float) -> list[dict]:
    return [{"choice": label, "logprob": math.log(p), "prob": p}
            for label, p in zip(("yes", "no", "unsure"), probs)]


def test_vote_counts_then_breaks_ties_by_probability_then_by_order() -> None:
    assert vote(["no", "yes", "no", "no", "unsure", "no", "yes", "no"],
                records(0.5, 0.3, 0.2)) == ("no", 0.625)
    # Two each: the likelier label wins the tie, whichever was drawn first.
    assert vote(["yes", "no", "yes", "no"], records(0.3, 0.6, 0.1)) == ("no", 0.5)
    assert vote(["no", "yes", "no", "yes"], records(0.6, 0.3, 0.1)) == ("yes", 0.5)
    # Equal probabilities too: the label listed first among the choices.
    assert vote(["unsure", "no"], records(0.2, 0.4, 0.4)) == ("no", 0.5)
    assert vote(["unsure"], records(0.2, 0.4, 0.4)) == ("unsure", 1.0)
    with pytest.raises(ValueError, match="at least one drawn choice"):
        vote([], records(0.5, 0.3, 0.2))


DOC = "the river stone is blue and the market is north of the quiet window"
QUESTIONS = ["is the stone blue?", "where is the market?"]
LABELS = ("yes", "no", "north market")
N = 16


def choice_requests(tmpl: str, samples: int, temperature: float = 3.0, seed: int | None = 5
                    ) -> list[QuestionRequest]:
    sampling = SamplingParams(temperature=temperature, seed=seed)
    return [QuestionRequest(i, DOC, q, sampling, tmpl, choices=LABELS, choice_norm="char",
                            samples=samples) for i, q in enumerate(QUESTIONS)]


def answers(engine, reqs, **kwargs) -> tuple[dict, object]:
    """(request key, sample) -> Answer, and the run's stats."""
    got = {}

    def keep(req, answer):
        assert (req.key, answer.sample) not in got
        got[(req.key, answer.sample)] = answer

    stats = engine.run(reqs, on_answer=keep, **kwargs)
    assert set(got) == {(r.key, s) for r in reqs for s in range(r.samples)}
    return got, stats


def test_a_question_of_n_samples_is_scored_once_and_drawn_n_times(tmp_path: Path) -> None:
    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    single, one = answers(engine, choice_requests(tmpl, samples=1), mode="stock")
    engine = tiny_engine("tiny-gqa")  # the same cold cache: the same tokens to forward
    drawn, many = answers(engine, choice_requests(tmpl, samples=N), mode="stock")
    assert many.prefilled_tokens == one.prefilled_tokens and many.steps == one.steps
    assert many.questions == len(QUESTIONS) * N
    for q in range(len(QUESTIONS)):
        best = single[(q, 0)]
        assert best.choice == max(zip(best.choice_probs, LABELS))[1]  # one answer: the best
        # The probabilities are the softmax of the compared scores, so their logs are the
        # scores up to a constant, which the draw's softmax ignores.
        scores = [math.log(p) for p in best.choice_probs]
        expected = draw_choices(scores, 3.0, seed=5, samples=N)
        for s in range(N):
            answer = drawn[(q, s)]
            assert answer.choice == answer.text == LABELS[expected[s]]
            assert answer.finish_reason == "choice" and answer.sample == s
            assert answer.choice_logprobs == pytest.approx(best.choice_logprobs, abs=1e-5)
            assert answer.choice_probs == pytest.approx(best.choice_probs, abs=1e-5)
        assert len({drawn[(q, s)].choice for s in range(N)}) > 1, "a hot draw gave one label"


def test_draws_are_the_same_in_every_mode_and_batch(tmp_path: Path) -> None:
    tmpl = plain_template(tmp_path)
    engine = tiny_engine("tiny-odd")
    got, _ = answers(engine, choice_requests(tmpl, N), mode="stock")
    stock = {k: a.choice for k, a in got.items()}
    for mode in ("parallel", "cascade", "auto"):
        got, _ = answers(engine, choice_requests(tmpl, N), mode=mode)
        assert {k: a.choice for k, a in got.items()} == stock, mode
    # Beside other questions (a generated one, another document), the draws stay.
    generated = QuestionRequest("gen", "another document", "what?",
                                SamplingParams(max_new_tokens=3, temperature=1.0, seed=1),
                                tmpl, samples=3)
    got, _ = answers(engine, [generated, *choice_requests(tmpl, N)], mode="parallel")
    assert {k: a.choice for k, a in got.items() if k[0] != "gen"} == stock
    other_seed, _ = answers(engine, choice_requests(tmpl, N, seed=6), mode="stock")
    assert {k: a.choice for k, a in other_seed.items()} != stock


def test_a_question_without_seed_takes_one_from_the_engine(tmp_path: Path) -> None:
    """Seedless questions draw from the engine's seeds (EngineConfig.seed), so two engines of
    one config draw the same; a question of one answer takes no seed."""
    tmpl = plain_template(tmp_path)
    first, _ = answers(tiny_engine("tiny-gqa", seed=9), choice_requests(tmpl, N, seed=None))
    again, _ = answers(tiny_engine("tiny-gqa", seed=9), choice_requests(tmpl, N, seed=None))
    assert {k: a.choice for k, a in first.items()} == {k: a.choice for k, a in again.items()}
    engine = tiny_engine("tiny-gqa", seed=9)
    answers(engine, choice_requests(tmpl, 1, seed=None))
    assert engine.next_seed() == random.Random(9).getrandbits(62)
