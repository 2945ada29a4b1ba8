"""The decode-step cost model behind mode="auto" and streams="auto"."""

import pytest

from ppqa.engine.runtime import cost_model as cm
from ppqa.engine.loading.presets import preset_config as _preset_config


def preset_config(name):
    return _preset_config(name)[0]

GPU = cm.DeviceRates.for_device("cuda")
MODES = ("stock", "cascade", "parallel")


def work(doc, questions, answer=128, question=14):
    return cm.Workload(doc_tokens=doc, questions=questions, question_tokens=question,
                       max_new_tokens=answer)


@pytest.mark.parametrize("doc,questions", [(8192, 64), (16384, 256)])
def test_long_shared_documents_leave_stock(doc, questions):
    mode, _, predicted = cm.choose(preset_config("codellama-7b"), work(doc, questions), GPU, MODES)
    assert mode != "stock"
    # a clear gain: on the H200 the smaller cell measured 3.41x over stock (run 5)
    assert predicted["stock"] > 3 * predicted[mode]


def test_one_question_or_tiny_documents_stay_stock():
    cfg = preset_config("qwen2.5-1.5b")
    assert cm.choose(cfg, work(16384, 1), GPU, MODES)[0] == "stock"
    assert cm.choose(cfg, work(64, 16, answer=16), GPU, MODES)[0] == "stock"


def test_parallel_cost_is_u_shaped_in_streams():
    """Few streams re-read the document often; many scan too many sibling tokens (the paper)."""
    cfg, w = preset_config("codellama-7b"), work(16384, 256, answer=1024)
    times = {p: cm.attention_seconds(cfg, w, "parallel", p, GPU) for p in cm.STREAM_CHOICES}
    best = cm.best_streams(cfg, w, GPU)
    assert times[min(times)] > times[best] and times[max(times)] > times[best]


def test_stock_attention_grows_with_questions_and_document():
    cfg = preset_config("codellama-7b")
    a = cm.attention_seconds(cfg, work(8192, 64), "stock", 1, GPU)
    assert cm.attention_seconds(cfg, work(16384, 64), "stock", 1, GPU) == pytest.approx(2 * a, rel=0.02)
    assert cm.attention_seconds(cfg, work(8192, 128), "stock", 1, GPU) == pytest.approx(2 * a)


# The H200 (benchmarks/results/h200/run5, run7): model, doc, questions, answer tokens, and the
# mode auto must pick. Cascade won clearly on every cell but one (run 4's long-answer cells are
# kept: cascade 5.4x / 4.4x there; run 7's 1,024-token cell 3.56x). On the tie (512/16:
# cascade 1.00-1.05x in run 5, 1.01x in run 7) auto must keep the baseline. Qwen2.5-1.5B 8k/64
# was a tie in run 5 (cascade 0.97-1.01x) and a clear cascade win in run 7 (1.34x, 1.37x).
MEASURED_CELLS = [("codellama-7b", d, q, 128, "cascade")
                  for d in (8192, 16384) for q in (64, 128, 256)] + [
    ("qwen2.5-7b", 8192, 64, 128, "cascade"), ("qwen2.5-7b", 16384, 256, 128, "cascade"),
    ("codellama-7b", 8192, 4, 128, "cascade"),
    ("codellama-7b", 8192, 128, 512, "cascade"), ("codellama-7b", 8192, 128, 1024, "cascade"),
    ("codellama-7b", 512, 16, 128, "stock"), ("qwen2.5-1.5b", 8192, 64, 128, "cascade")]


@pytest.mark.parametrize("model,doc,questions,answer,expected", MEASURED_CELLS)
def test_auto_picks_the_mode_measured_fastest_on_the_h200(model, doc, questions, answer, expected):
    """The byte tokenizer of the dummy presets makes each benchmark question ~60 tokens."""
    cfg = preset_config(model)
    mode, _, _ = cm.choose(cfg, work(doc, questions, answer, question=60), GPU, MODES)
    assert mode == expected
