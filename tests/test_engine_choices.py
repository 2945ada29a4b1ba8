"""Questions answered by scoring choices: every mode gives the same log-probabilities, which
equal those of one plain causal forward of document + question + choice in transformers.

Tiny random models (MHA, GQA with bias, one KV head with odd sizes); the plain template (the
document, then the question, then " " + the choice; one byte a token), so choices of one and
of several tokens, documents of several lengths and several documents in one run are exact.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from ppqa import QuestionRequest, SamplingParams
from ppqa.choices import choice_probabilities, normalise
from tests.helpers import (PLAIN_TEMPLATE, assert_pool_holds_only_cached_documents, hf_twin,
                           plain_template, text, tiny_engine)

MODELS = ["tiny-mha", "tiny-gqa", "tiny-odd"]
MODES = ["stock", "cascade", "parallel", "auto"]


def workload(rng: random.Random, docs: int = 2) -> list[tuple[str, str, tuple[str, ...]]]:
    """(document, question, choices): multi-token labels of unequal lengths, single letters,
    and a mix, over documents of 0 to 120 characters."""
    out = []
    for d in range(docs):
        doc = text(rng, [0, 37, 120][d % 3])
        for q in range(5):
            kind = q % 3
            if kind == 0:
                choices = ("A", "B", "C", "D")
            elif kind == 1:
                choices = tuple(rng.sample(["yes", "no", "unsure", "north market", "blue"], 3))
            else:
                choices = ("x", "seven stones", "quiet")
            out.append((doc, text(rng, rng.randint(1, 15)), choices))
    return out


def scored(engine, items, tmpl: str, mode: str, norm: str = "none") -> dict:
    requests = [QuestionRequest(i, doc, q, template=tmpl, choices=c, choice_norm=norm)
                for i, (doc, q, c) in enumerate(items)]
    got = {}
    engine.run(requests, mode=mode, on_answer=lambda r, a: got.__setitem__(r.key, a))
    assert sorted(got) == list(range(len(items)))
    return got


@pytest.mark.parametrize("preset", MODELS)
def test_every_mode_gives_stocks_logprobs(preset: str, tmp_path: Path) -> None:
    engine = tiny_engine(preset)
    tmpl = plain_template(tmp_path)
    items = workload(random.Random(preset), docs=3)
    stock = scored(engine, items, tmpl, "stock")
    for mode in MODES[1:]:
        other = scored(engine, items, tmpl, mode)
        for i, (doc, q, choices) in enumerate(items):
            assert other[i].mode == ("parallel" if mode == "auto" else mode)
            torch.testing.assert_close(torch.tensor(other[i].choice_logprobs),
                                       torch.tensor(stock[i].choice_logprobs),
                                       rtol=1e-5, atol=1e-5, msg=f"{mode} question {i}")
            assert other[i].choice == stock[i].choice
    assert_pool_holds_only_cached_documents(engine)


@pytest.mark.parametrize("preset", MODELS)
def test_logprobs_equal_a_plain_forward_in_transformers(preset: str, tmp_path: Path) -> None:
    """The reference: transformers' own model holding the same weights, one causal forward of
    the whole sequence per choice (no cache, no stream mask), log-softmax, sum."""
    from ppqa.engine.loading.loader import load_model

    engine = tiny_engine(preset)
    twin = hf_twin(engine.model_config, load_model(f"dummy:{preset}", device="cpu").weights)
    tmpl = plain_template(tmp_path)
    items = workload(random.Random(f"hf-{preset}"), docs=2)
    answers = scored(engine, items, tmpl, "parallel")
    for i, (doc, q, choices) in enumerate(items):
        prompt = engine.tokenizer.prompt(tmpl, doc, [q])
        for c, label in enumerate(choices):
            choice_ids = list((" " + label).encode())  # the plain template: a space, the label
            ids = torch.tensor([prompt.ids(0) + choice_ids])
            with torch.no_grad():
                logp = torch.log_softmax(twin(ids).logits[0].float(), dim=-1)
            start = len(prompt.ids(0))
            want = sum(float(logp[start - 1 + j, t]) for j, t in enumerate(choice_ids))
            assert answers[i].choice_logprobs[c] == pytest.approx(want, abs=1e-4), (i, c)


def test_answer_fields_and_norms(tmp_path: Path) -> None:
    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    items = workload(random.Random("norms"), docs=1)
    for norm in ("none", "token", "char"):
        answers = scored(engine, items, tmpl, "parallel", norm)
        for i, (_, _, choices) in enumerate(items):
            a = answers[i]
            lengths = [len(" " + c) for c in choices]  # bytes = tokens = characters here
            scores = [normalise(lp, n, n, norm) for lp, n in zip(a.choice_logprobs, lengths)]
            best = max(range(len(choices)), key=scores.__getitem__)
            assert (a.choice, a.text, a.finish_reason) == (choices[best], choices[best], "choice")
            assert a.token_ids == list((" " + choices[best]).encode())
            assert math.isclose(sum(a.choice_probs), 1.0, rel_tol=1e-9)
            assert a.choice_probs == pytest.approx(choice_probabilities(scores))
            assert all(lp < 0 for lp in a.choice_logprobs)
            assert a.decode_s == 0.0 and a.prefill_s > 0


def test_single_token_choices_forward_no_choice_tokens(tmp_path: Path) -> None:
    """Letters are read off the question's last logits: the run prefills the document and the
    questions only, in every mode (the template scores the bare letter: one byte, one token)."""
    tmpl = tmp_path / "letters.jinja"
    tmpl.write_text(PLAIN_TEMPLATE + "{% block choice %}{{ choice }}{% endblock %}")
    tmpl = str(tmpl)
    doc, questions = "a document about the river", ["which?", "and this one, which?"]
    for mode in ("stock", "parallel"):
        engine = tiny_engine("tiny-mha")
        got = {}
        stats = engine.run([QuestionRequest(i, doc, q, template=tmpl, choices=("A", "B", "C"))
                            for i, q in enumerate(questions)], mode=mode,
                           on_answer=lambda r, a: got.__setitem__(r.key, a))
        prompt = engine.tokenizer.prompt(tmpl, doc, questions).with_common_opening()
        assert stats.prefilled_tokens == len(prompt.prefix_ids) + sum(map(len, prompt.suffix_ids))
        assert len(got) == 2 and stats.steps == 2  # the document, then one scoring forward
        assert all(len(a.choice_logprobs) == 3 for a in got.values())


def test_scoring_beside_generation_changes_neither(tmp_path: Path) -> None:
    """One session holding generated and scored questions of the same documents: the
    generated tokens are those of a run without scoring, the scores those of a run alone."""
    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    rng = random.Random("mixed")
    items = workload(rng, docs=2)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    generate = [QuestionRequest(("g", i), doc, q + "?", sampling, tmpl)
                for i, (doc, q, _) in enumerate(items)]
    alone = {}
    engine.run(generate, mode="parallel", on_answer=lambda r, a: alone.__setitem__(r.key, a))
    scores_alone = scored(engine, items, tmpl, "stock")
    together = {}
    engine.run(generate + [QuestionRequest(("s", i), doc, q, template=tmpl, choices=c)
                           for i, (doc, q, c) in enumerate(items)],
               mode="stock", on_answer=lambda r, a: together.__setitem__(r.key, a))
    assert len(together) == 2 * len(items)
    for i in range(len(items)):
        assert together[("g", i)].token_ids == alone[("g", i)].token_ids
        assert together[("s", i)].choice_logprobs == pytest.approx(
            scores_alone[i].choice_logprobs, abs=1e-5)
    assert_pool_holds_only_cached_documents(engine)


def test_cancelled_scoring_question_gets_no_answer(tmp_path: Path) -> None:
    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    got = {}
    session = engine.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit([QuestionRequest(i, "some document", f"question {i}", template=tmpl,
                                    choices=("yes", "no way")) for i in range(4)], mode="stock")
    assert session.open_questions == 4  # questions, not their per-choice requests
    assert session.cancel(lambda r: r.key in (1, 2)) == 2
    session.drain()
    session.close()
    assert sorted(got) == [0, 3]
    assert_pool_holds_only_cached_documents(engine)


def test_too_long_choices_are_rejected_alone(tmp_path: Path) -> None:
    engine = tiny_engine("tiny-gqa", kv_token_budget=256)
    tmpl = plain_template(tmp_path)
    errors, got = {}, {}
    engine.run([QuestionRequest(0, "doc", "fits?", template=tmpl, choices=("yes", "no")),
                QuestionRequest(1, "doc", "does not", template=tmpl,
                                choices=("y" * 200, "n" * 200))],
               on_answer=lambda r, a: got.__setitem__(r.key, a),
               on_error=lambda r, e: errors.__setitem__(r.key, e))
    assert list(got) == [0] and list(errors) == [1]
    assert "do not fit the KV pool" in str(errors[1])


def test_engine_score_api_checks_its_arguments() -> None:
    engine = tiny_engine("tiny-gqa")
    answers = engine.score("doc", ["q1", "q2"], ["yes", "no"])
    assert [a.question_index for a in answers] == [0, 1]
    assert all(a.choice in ("yes", "no") for a in answers)
    with pytest.raises(ValueError, match="at least two choices"):
        engine.score("doc", ["q"], ["only"])
    with pytest.raises(ValueError, match="duplicate choice"):
        engine.score("doc", ["q"], ["a", "a"])
    with pytest.raises(ValueError, match="2 choice lists for 1 questions"):
        engine.score("doc", ["q"], [["a", "b"], ["c", "d"]])
    with pytest.raises(ValueError, match="choice_norm must be one of"):
        engine.score("doc", ["q"], ["a", "b"], norm="bytes")


def test_a_large_batch_of_choices_is_split_into_bounded_forwards(tmp_path: Path,
                                                              monkeypatch) -> None:
    """A scoring forward reads at most a bounded number of logit rows (their logits are rows x
    vocabulary), unless one question alone reads more; the split changes no log-probability."""
    from ppqa.engine.runtime import scoring

    engine = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    items = workload(random.Random("split"), docs=1)
    whole = scored(engine, items, tmpl, "parallel")
    cap, seen = 12, []
    original = scoring.score_layout

    def spy(requests):
        plan = original(requests)
        seen.append((len(requests), plan.logit_indices.numel()))
        return plan

    monkeypatch.setattr("ppqa.engine.runtime.steps.score_layout", spy)
    monkeypatch.setattr("ppqa.engine.prefilling.split_by_rows",
                        lambda reqs: scoring.split_by_rows(reqs, cap))
    split = scored(engine, items, tmpl, "parallel")
    assert len(seen) > 1 and sum(n for n, _ in seen) == len(items)
    assert all(rows <= cap or n == 1 for n, rows in seen), seen
    for i in whole:
        assert split[i].choice_logprobs == pytest.approx(whole[i].choice_logprobs, abs=1e-5)
