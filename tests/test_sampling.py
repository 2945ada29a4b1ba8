"""Sampling: counter-based noise, filters, batch independence, and through the engine: the same seed
gives the same answer in every mode; stop strings, EOS and max_new_tokens end answers correctly.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ppqa import SamplingParams
from ppqa.engine.runtime.sampling import SamplingBatch, counter_uniform, sample
from tests.helpers import plain_template, text, tiny_engine


def batch(rows: int, temperature=1.0, top_p=1.0, top_k=0, seeds=None, steps=None) -> SamplingBatch:
    def full(value, dtype):
        return torch.full((rows,), value, dtype=dtype)
    return SamplingBatch(temperature=full(temperature, torch.float32), top_p=full(top_p, torch.float32),
                         top_k=full(top_k, torch.int64),
                         seed=torch.tensor(seeds) if seeds is not None else torch.arange(rows),
                         step=torch.tensor(steps) if steps is not None else torch.zeros(rows, dtype=torch.int64))


def test_counter_uniform_is_a_pure_function_in_the_open_interval() -> None:
    seeds, steps = torch.tensor([0, 1, 2**40 + 7, 0]), torch.tensor([0, 0, 3, 1])
    u = counter_uniform(seeds, steps, 50_000)
    assert torch.equal(u, counter_uniform(seeds, steps, 50_000))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])  # seed and step both matter
    assert torch.equal(counter_uniform(seeds[2:3], steps[2:3], 50_000)[0], u[2])  # row independent
    mean, var = float(u.mean()), float(u.var())
    assert abs(mean - 0.5) < 0.005 and abs(var - 1 / 12) < 0.002


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, batch(6, temperature=0.0)), best)
    assert torch.equal(sample(logits, batch(6, temperature=2.0, top_k=1)), best)
    assert torch.equal(sample(logits, batch(6, temperature=2.0, top_p=1e-6)), best)


def test_sampled_distribution_and_filters() -> None:
    vocab, draws = 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(draws, vocab)
    tokens = sample(logits, batch(draws, seeds=list(range(draws))))
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    torch.testing.assert_close(freq, torch.softmax(logits[0], 0), atol=0.02, rtol=0)
    top_k = sample(logits, batch(draws, top_k=2, seeds=list(range(draws))))
    assert set(top_k.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], 0)  # 0.59, 0.22, 0.13, ...: top_p 0.7 keeps the first two
    top_p = sample(logits, batch(draws, top_p=0.7, seeds=list(range(draws))))
    assert set(top_p.tolist()) == {0, 1} and float(probs[:1].sum()) < 0.7
    hot = sample(logits, batch(draws, temperature=100.0, seeds=list(range(draws))))
    assert len(set(hot.tolist())) == vocab


def test_a_row_samples_the_same_alone_or_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 100, generator=gen)
    params = batch(5, temperature=0.9, top_p=0.8, top_k=20, seeds=[5, 6, 7, 8, 9], steps=[0, 4, 4, 1, 2])
    together = sample(logits, params)
    order = [3, 0, 4, 1, 2]
    shuffled = SamplingBatch(*(getattr(params, f)[order] for f in ("temperature", "top_p", "top_k",
                                                                   "seed", "step")))
    assert torch.equal(sample(logits[order], shuffled), together[order])


# ---- through the engine -----------------------------------------------------------------------


def test_seeded_sampling_is_identical_across_modes_and_runs(tmp_path: Path) -> None:
    eng = tiny_engine("tiny-gqa")
    tmpl = plain_template(tmp_path)
    rng = random.Random(4)
    doc = text(rng, 90)
    questions = [text(rng, rng.randint(3, 12)) for _ in range(7)]
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=50, seed=100 + i,
                             ignore_eos=True) for i in range(7)]
    params[3] = SamplingParams(max_new_tokens=10, ignore_eos=True)  # a greedy one in the same batch
    runs = {mode: [a.token_ids for a in eng.answer(doc, questions, mode=mode, sampling=params,
                                                   streams=3, template=tmpl)]
            for mode in ("stock", "parallel", "cascade")}
    assert runs["stock"] == runs["parallel"] == runs["cascade"]
    again = eng.answer(doc, questions, mode="parallel", sampling=params, streams=4, template=tmpl)
    assert [a.token_ids for a in again] == runs["stock"]
    reseeded = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=50, seed=7 + i,
                               ignore_eos=True) for i in range(7)]
    other = eng.answer(doc, questions, mode="stock", sampling=reseeded, template=tmpl)
    assert [a.token_ids for a in other] != runs["stock"]
    greedy = eng.answer(doc, questions, mode="stock", template=tmpl,
                        sampling=SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert greedy[3].token_ids == runs["stock"][3]


@pytest.mark.parametrize("mode", ["stock", "parallel", "cascade"])
def test_stop_strings_eos_and_length(mode: str, tmp_path: Path) -> None:
    eng = tiny_engine("tiny-mha")
    tmpl = plain_template(tmp_path)
    doc, question = "the river is blue and quiet", "what color"
    free = eng.answer(doc, [question], mode="stock", template=tmpl,
                      sampling=SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert len(free.token_ids) == 24 and free.finish_reason == "length"
    # Stop string: the text ends before its first occurrence; the ids run up to the token that
    # completed it.
    chars = [c for c in free.text if c.isalnum()]
    stop = chars[len(chars) // 2]
    cut = free.text.index(stop)
    got = eng.answer(doc, [question, question], mode=mode, template=tmpl, streams=2,
                     sampling=[SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop, "@@")),
                               SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert got[0].finish_reason == "stop" and got[0].text == free.text[:cut]
    assert got[0].token_ids == free.token_ids[:len(got[0].token_ids)]
    assert stop in eng.tokenizer.decode(got[0].token_ids)  # its last token completed the stop
    assert stop not in eng.tokenizer.decode(got[0].token_ids[:-1])
    assert got[1].finish_reason == "length" and got[1].token_ids == free.token_ids[:5]
    # EOS: a token greedy emits at position 6 ends the answer there (not included), unless ignored.
    eos = free.token_ids[6]
    first = free.token_ids.index(eos)
    eng.tokenizer.eos_token_ids = [eos]
    got = eng.answer(doc, [question, question], mode=mode, template=tmpl, streams=2,
                     sampling=[SamplingParams(max_new_tokens=24),
                               SamplingParams(max_new_tokens=24, ignore_eos=True)])
    assert got[0].finish_reason == "stop" and got[0].token_ids == free.token_ids[:first]
    assert got[0].text == eng.tokenizer.decode(free.token_ids[:first])
    assert got[1].finish_reason == "length" and got[1].token_ids == free.token_ids
