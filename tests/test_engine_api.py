"""The public API's contract: lazy imports, validation, clear errors, `run` with on_error and
should_stop, what `mode="auto"` picks. (The helpers the engine tests share are in tests/helpers.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ppqa import Engine, EngineConfig, PromptTooLongError, QuestionRequest, SamplingParams
from ppqa.config import default_prefill_tokens
from tests.helpers import assert_pool_holds_only_cached_documents, plain_template, tiny_engine


# ---- import hygiene ---------------------------------------------------------------------------


def test_import_ppqa_is_light_and_engine_avoids_store_packages() -> None:
    code = (
        "import sys, ppqa\n"
        "from ppqa import SamplingParams, EngineConfig, QuestionRequest\n"
        "assert 'torch' not in sys.modules, 'import ppqa pulled in torch'\n"
        "assert ppqa.__version__ == '0.1.0'\n"
        "import ppqa.engine.engine, ppqa.engine.setup, ppqa.engine.runtime.scheduler\n"
        "import ppqa.engine.runtime.runner, ppqa.engine.attention.torch_backend, ppqa.engine.runtime.sampling\n"
        "bad = [m for m in ('sqlalchemy', 'pydantic', 'gguf', 'platformdirs') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from ppqa import Engine\n"
        "assert Engine.__module__ == 'ppqa.engine.engine'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr


def test_a_cpu_engine_keeps_torchs_threads() -> None:
    """The model's matrix work runs on the host's intra-op threads: a CPU engine keeps their
    count (a GPU engine sets one for its bookkeeping, tests/gpu/test_engine_overlap_gpu.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        Engine("dummy:tiny-mha", device="cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_unknown_public_name() -> None:
    import ppqa

    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        ppqa.Engin  # noqa: B018


# ---- dataclass validation ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"seed": -3}, "seed must be None or an integer >= 0"),
    ({"stop": ("ok", "")}, "stop must hold non-empty strings"),
])
def test_sampling_params_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("kwargs,message", [
    ({"attention_backend": "cuda"}, "attention_backend must be one of auto, torch, triton"),
    ({"kv_token_budget": 3}, "kv_token_budget must be an integer >= 16"),
    ({"mem_fraction": 1.5}, r"mem_fraction must be in \(0, 1\]"),
    ({"default_streams": 0}, "default_streams must be an integer >= 1"),
    ({"dtype": "int8"}, "dtype must be one of float32, bfloat16, float16"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be None or an integer >= 1"),
])
def test_engine_config_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_engine_config_resolution() -> None:
    eng = tiny_engine("tiny-mha")
    assert eng.config.device == "cpu" and eng.config.dtype == "float32"
    assert eng.config.attention_backend == "torch"
    assert eng.model_name == "dummy:tiny-mha" and eng.model_config.num_layers == 2
    assert eng.tokenizer.eos_token_ids == [257]
    # a prefill chunk left to the device: the CPU's (its attention holds a chunk's scores)
    assert EngineConfig().max_prefill_tokens is None
    assert eng.config.max_prefill_tokens == default_prefill_tokens("cpu") == 8192
    assert default_prefill_tokens("cuda") == 16384
    assert tiny_engine("tiny-mha", max_prefill_tokens=96).config.max_prefill_tokens == 96


# ---- errors -----------------------------------------------------------------------------------


def test_answer_argument_errors() -> None:
    eng = tiny_engine()
    with pytest.raises(ValueError, match="no questions"):
        eng.answer("doc", [])
    with pytest.raises(TypeError, match="not one string"):
        eng.answer("doc", "a question")
    with pytest.raises(ValueError, match="unknown mode 'fast'.*auto, stock, parallel, cascade"):
        eng.answer("doc", ["q?"], mode="fast")
    with pytest.raises(ValueError, match="streams must be None, 'auto' or an integer >= 1, got 0"):
        eng.answer("doc", ["q?"], mode="parallel", streams=0)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 questions"):
        eng.answer("doc", ["q?"], sampling=[SamplingParams(), SamplingParams()])


def test_too_long_for_the_context_names_the_numbers(tmp_path: Path) -> None:
    eng = tiny_engine()  # context 4096
    with pytest.raises(PromptTooLongError) as info:
        eng.answer("x" * 4000, ["q" * 50], sampling=SamplingParams(max_new_tokens=100),
                   template=plain_template(tmp_path))
    msg = str(info.value)
    assert "document (4001 tokens) + question (50 tokens) + max_new_tokens (100) = 4151" in msg
    assert "context of 4096" in msg
    assert info.value.needed == 4151 and info.value.available == 4096
    assert isinstance(info.value, ValueError)


def test_pool_too_small_for_one_document_names_the_numbers(tmp_path: Path) -> None:
    eng = tiny_engine(kv_token_budget=100)
    with pytest.raises(PromptTooLongError, match=r"= 226 tokens do not fit the KV pool, which holds "
                                                 r"100 tokens.*kv_token_budget.*--kv-tokens"):
        eng.answer("d" * 199, ["q" * 10], sampling=SamplingParams(max_new_tokens=16),
                   template=plain_template(tmp_path))


def test_run_reports_unfit_requests_and_answers_the_rest(tmp_path: Path) -> None:
    eng = tiny_engine(kv_token_budget=300)
    tmpl = plain_template(tmp_path)
    sp = SamplingParams(max_new_tokens=4)
    requests = [QuestionRequest("ok1", "short doc", "q one", sp, tmpl),
                QuestionRequest("long", "L" * 400, "q", sp, tmpl),
                QuestionRequest("ok2", "short doc", "q two", sp, tmpl),
                QuestionRequest("badtmpl", "short doc", "q", sp, "no-such-template")]
    answers, errors = {}, {}
    stats = eng.run(requests, mode="parallel", on_answer=lambda r, a: answers.__setitem__(r.key, a),
                    on_error=lambda r, e: errors.__setitem__(r.key, e))
    assert set(answers) == {"ok1", "ok2"} and set(errors) == {"long", "badtmpl"}
    assert isinstance(errors["long"], PromptTooLongError)
    assert "unknown template 'no-such-template'" in str(errors["badtmpl"])
    assert stats.questions == 2 and stats.errors == 2 and stats.mode == "parallel"
    assert stats.streams == 2 and stats.answer_tokens == sum(len(a.token_ids) for a in answers.values())
    assert all(a.prompt_tokens == 10 + 5 for a in answers.values())  # BOS + "short doc" + "q one"


def test_should_stop_drops_in_flight_work_and_frees_the_pool(tmp_path: Path) -> None:
    eng = tiny_engine()
    tmpl = plain_template(tmp_path)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    requests = [QuestionRequest(i, "a document", f"question {i}", sp, tmpl) for i in range(6)]
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 3  # a few steps in, nothing has finished yet

    got = []
    stats = eng.run(requests, mode="stock", on_answer=lambda r, a: got.append(r.key), should_stop=stop)
    assert stats.stopped and got == [] and stats.questions == 0
    assert_pool_holds_only_cached_documents(eng)
    assert len(eng.parts.docs) == 1  # the document stays cached for the next run
    # The engine still works afterwards, and the cached document is reused.
    answers = eng.answer("a document", ["question 0"], sampling=sp, template=tmpl)
    assert len(answers[0].token_ids) == 30 and answers[0].finish_reason == "length"


def test_auto_mode_choice() -> None:
    """One question: stock. Many questions about a long document on the CPU: parallel, which
    reads the document once per request of P streams rather than once per question, with P > 1
    (the cost model's choice, runtime/cost_model.py). Either way: stock's answers."""
    eng = tiny_engine()
    sp = SamplingParams(max_new_tokens=4)
    document = "The ferry leaves at seven and returns at nine. " * 40
    one = eng.run([QuestionRequest(0, document, "When does it leave?", sp)], mode="auto")
    assert (one.mode, one.streams) == ("stock", 1)
    questions = [f"What happens at hour {i}?" for i in range(8)]
    auto, stock = {}, {}
    many = eng.run([QuestionRequest(i, document, q, sp) for i, q in enumerate(questions)],
                   mode="auto", on_answer=lambda r, a: auto.__setitem__(r.key, a.token_ids))
    eng.run([QuestionRequest(i, document, q, sp) for i, q in enumerate(questions)],
            mode="stock", on_answer=lambda r, a: stock.__setitem__(r.key, a.token_ids))
    assert many.mode == "parallel" and 1 < many.streams <= len(questions)
    assert auto == stock and len(auto) == len(questions)
    # streams="auto" with the mode given: the cost model's P, the questions packed by it.
    par = eng.run([QuestionRequest(i, "doc", f"q{i}", sp) for i in range(5)], mode="parallel",
                  streams="auto")
    assert par.mode == "parallel" and 1 < par.streams <= 5
    assert par.max_batch_requests == -(-5 // par.streams)  # ceil(Q / P) requests


def test_pack_streams_balances_requests_and_respects_the_pool() -> None:
    from ppqa.engine.runtime.batching import pack_streams

    assert pack_streams([5] * 40, 32, 100, 10_000) == [list(range(20)), list(range(20, 40))]
    assert pack_streams([5] * 3, 32, 100, 10_000) == [[0, 1, 2]]
    # 100 document tokens + 8 x 50 reserved > 300: split until each request fits.
    groups = pack_streams([50] * 8, 8, 100, 300)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 100 + 4 x 50 = 300 fits exactly
    assert len(pack_streams([50] * 8, 8, 101, 300)) == 4


def test_from_loaded_builds_the_same_engine_as_a_spec(tmp_path: Path) -> None:
    import torch

    from ppqa.engine.loading.loader import LoadedModel
    from ppqa.engine.loading.presets import dummy_weights, preset_config

    config, std, tokenizer = preset_config("tiny-odd")
    weights = list(dummy_weights(config, std, device=torch.device("cpu"), dtype=torch.float32, seed=0))
    eng = Engine.from_loaded(LoadedModel(config, weights, tokenizer, "test weights"), device="cpu",
                             config=EngineConfig(kv_token_budget=512), model_name="mine")
    assert eng.model_name == "mine" and eng.config.kv_token_budget == 512
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    tmpl = plain_template(tmp_path)
    ours = eng.answer("some document", ["q1", "q22"], mode="parallel", sampling=sp, template=tmpl)
    spec = tiny_engine("tiny-odd").answer("some document", ["q1", "q22"], mode="stock",
                                          sampling=sp, template=tmpl)
    assert [a.token_ids for a in ours] == [a.token_ids for a in spec]
    assert [a.question_index for a in ours] == [0, 1]


def test_close_lets_go_of_the_parts_at_once_and_the_engine_answers_nothing_after() -> None:
    import gc
    import weakref

    gc.disable()  # no automatic collection may free them: only close
    try:
        with tiny_engine("tiny-gqa") as eng:
            assert eng.answer("Some document text.", ["A question?"])[0].token_ids
            pool = weakref.ref(eng.parts.pool)
        assert pool() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match=r"this engine \(dummy:tiny-gqa\) is closed"):
        eng.answer("Some document text.", ["A question?"])
    with pytest.raises(RuntimeError, match="is closed"):
        eng.session()
    eng.close()  # idempotent

