"""The decode-step cost model behind mode="auto" and streams="auto" (engine/runtime/cost_model.py):
its promises, over a grid of models, documents, question counts, answer budgets and devices.

- one question is answered by stock;
- auto never picks a mode the model itself predicts slower than stock, and leaves stock only
  for a predicted gain of at least MIN_GAIN, taking then the fastest candidate;
- streams="auto" is the P of the least predicted parallel time;
- predicted times grow with the work (document, questions, answer budget).

Whether the predictions agree with measured runs is a benchmark, not a test:
benchmarks/check_cost_model.py prints the agreement with the cells in benchmarks/RESULTS.md.
"""

import itertools

import pytest

from ppqa.engine.loading.presets import preset_config, preset_names
from ppqa.engine.runtime import cost_model as cm

MODELS = [n for n in preset_names() if not n.startswith("tiny")] + ["tiny-gqa", "tiny-mha"]
RATES = {kind: cm.DeviceRates.for_device(kind) for kind in ("cuda", "cpu")}
CANDIDATES = {"cuda": [("stock", "cascade"), ("stock", "cascade", "parallel")],
              "cpu": [("stock", "parallel"), ("stock", "cascade", "parallel")]}
DOCS, QUESTIONS, ANSWERS = (64, 512, 4096, 16384), (2, 4, 16, 64, 256), (16, 128, 1024)


def config(model):
    return preset_config(model)[0]


def work(doc, questions, answer=128, question=14):
    return cm.Workload(doc_tokens=doc, questions=questions, question_tokens=question,
                       max_new_tokens=answer)


def grid():
    for model, kind in itertools.product(MODELS, RATES):
        for modes in CANDIDATES[kind]:
            yield model, kind, modes


@pytest.mark.parametrize("model,kind,modes", list(grid()))
def test_one_question_is_answered_by_stock(model, kind, modes):
    cfg = config(model)
    for doc, answer, question in itertools.product(DOCS, ANSWERS, (1, 60)):
        mode, streams, _ = cm.choose(cfg, work(doc, 1, answer, question), RATES[kind], modes)
        assert (mode, streams) == ("stock", 1), (doc, answer, question)


@pytest.mark.parametrize("model,kind,modes", list(grid()))
def test_auto_is_never_predicted_slower_than_stock(model, kind, modes):
    cfg, rates = config(model), RATES[kind]
    left_stock = 0
    for doc, questions, answer in itertools.product(DOCS, QUESTIONS, ANSWERS):
        w = work(doc, questions, answer)
        mode, streams, predicted = cm.choose(cfg, w, rates, modes)
        assert set(predicted) == set(modes)
        assert predicted[mode] <= predicted["stock"]
        fastest = min(predicted, key=predicted.get)
        if predicted["stock"] >= cm.MIN_GAIN * predicted[fastest]:
            assert mode == fastest  # a clear gain: the fastest candidate
        else:
            assert mode == "stock"  # within the model's error: the baseline
        if mode != "stock":
            left_stock += 1
            assert predicted["stock"] >= cm.MIN_GAIN * predicted[mode]
        assert streams == (cm.best_streams(cfg, w, rates) if mode == "parallel" else 1)
    if kind == "cuda" and not model.startswith("tiny"):
        assert left_stock > 0  # the premise: some cells of the grid leave stock


LONG_SHARED = [(m, "cuda", ("stock", "cascade")) for m in MODELS if not m.startswith("tiny")] + [
    (m, "cpu", ("stock", "parallel")) for m in MODELS if config(m).num_kv_heads == config(m).num_heads]


@pytest.mark.parametrize("model,kind,modes", LONG_SHARED)
def test_a_long_document_shared_by_many_questions_leaves_stock(model, kind, modes):
    """What the modes are for: stock reads a 16k-token document once per question. (On the CPU
    only where every query head has its own KV head: with grouped queries the model has parallel
    bound by its FLOPs there, which cost more than stock's reads; on a GPU tiny models are
    bound by the step's overhead.)"""
    mode, _, predicted = cm.choose(config(model), work(16384, 256), RATES[kind], modes)
    assert mode != "stock", predicted


@pytest.mark.parametrize("model,kind", list(itertools.product(MODELS, RATES)))
def test_best_streams_is_the_cheapest_choice_and_at_most_the_questions(model, kind):
    cfg, rates = config(model), RATES[kind]
    for doc, questions, answer in itertools.product(DOCS, QUESTIONS, ANSWERS):
        w = work(doc, questions, answer)
        best = cm.best_streams(cfg, w, rates)
        assert 1 <= best <= questions
        cost = cm.attention_seconds(cfg, w, "parallel", best, rates)
        for p in (*cm.STREAM_CHOICES, questions):
            assert cost <= cm.attention_seconds(cfg, w, "parallel", min(p, questions), rates)


def test_parallel_cost_is_u_shaped_in_streams():
    """Few streams re-read the document often; many scan too many sibling tokens (the paper)."""
    cfg, w, gpu = config("codellama-7b"), work(16384, 256, answer=1024), RATES["cuda"]
    times = {p: cm.attention_seconds(cfg, w, "parallel", p, gpu) for p in cm.STREAM_CHOICES}
    best = cm.best_streams(cfg, w, gpu)
    assert times[min(times)] > times[best] and times[max(times)] > times[best]


@pytest.mark.parametrize("model,kind", list(itertools.product(MODELS, RATES)))
def test_predicted_time_grows_with_the_work(model, kind):
    cfg, rates = config(model), RATES[kind]

    def seconds(mode, doc, questions, answer, streams=8):
        w = work(doc, questions, answer)
        return cm.shared_seconds(cfg, w, rates) + cm.attention_seconds(cfg, w, mode, streams, rates)

    for mode in ("stock", "cascade", "parallel"):
        for doc, questions, answer in itertools.product(DOCS, QUESTIONS, ANSWERS):
            here = seconds(mode, doc, questions, answer)
            assert seconds(mode, 2 * doc, questions, answer) >= here
            assert seconds(mode, doc, 2 * questions, answer) >= here
            assert seconds(mode, doc, questions, 2 * answer) >= here


def test_stock_attention_is_linear_in_questions_and_in_rows():
    """Stock reads each question's whole row (document + question + half the budget)."""
    cfg, gpu = config("codellama-7b"), RATES["cuda"]
    w = work(8192, 64)
    a = cm.attention_seconds(cfg, w, "stock", 1, gpu)
    assert cm.attention_seconds(cfg, work(8192, 128), "stock", 1, gpu) == pytest.approx(2 * a)
    longer = work(2 * (8192 + 14 + 64), 64, answer=0, question=0)  # twice the row, all document
    assert cm.attention_seconds(cfg, longer, "stock", 1, gpu) == pytest.approx(2 * a)


@pytest.mark.parametrize("model,kind", list(itertools.product(MODELS, RATES)))
def test_documents_in_one_step_share_its_weights_and_cascades_floor(model, kind):
    """D documents of Q questions decoding together: each is charged 1/D of the step's shared
    part (which is that of one document of D x Q questions) and of cascade's per-layer floor;
    the other costs of attention are each document's own."""
    cfg, rates = config(model), RATES[kind]
    for doc, questions, documents in itertools.product(DOCS, QUESTIONS, (2, 14)):
        alone = work(doc, questions)
        together = cm.Workload(doc, questions, alone.question_tokens, alone.max_new_tokens,
                               documents=documents)
        whole = work(doc, questions * documents)
        assert documents * cm.shared_seconds(cfg, together, rates) == \
            pytest.approx(cm.shared_seconds(cfg, whole, rates))
        for mode in ("stock", "parallel"):
            assert cm.attention_seconds(cfg, together, mode, 8, rates) == \
                cm.attention_seconds(cfg, alone, mode, 8, rates)
        floor = cfg.num_layers * rates.cascade_layer_floor_s
        shared = cm.attention_seconds(cfg, together, "cascade", 1, rates)
        assert shared <= cm.attention_seconds(cfg, alone, "cascade", 1, rates)
        assert shared >= cm.attention_seconds(cfg, alone, "cascade", 1, rates) - floor


def test_a_document_stock_would_answer_alone_takes_cascade_among_many():
    """QuALITY's shape on Qwen2.5-7B (5.7k tokens, 18 questions, 16-token answers): alone,
    cascade's per-layer floor outweighs 18 reads of the document; the ~14 documents of a
    256-request step share the floor, and cascade is the cheaper step."""
    cfg, gpu = config("qwen2.5-7b"), RATES["cuda"]
    w = dict(doc_tokens=5700, questions=18, question_tokens=40, max_new_tokens=16)
    assert cm.choose(cfg, cm.Workload(**w), gpu, ("stock", "cascade"))[0] == "stock"
    assert cm.choose(cfg, cm.Workload(**w, documents=14), gpu, ("stock", "cascade"))[0] == "cascade"


def test_unknown_mode_has_no_cost():
    with pytest.raises(ValueError, match="no cost model for mode 'fast'"):
        cm.attention_seconds(config("tiny-gqa"), work(64, 2), "fast", 1, RATES["cpu"])
