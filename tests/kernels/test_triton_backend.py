"""The golden test through the Triton backend: on a tiny random model in float32, every mode
(stock, parallel, cascade) run on TritonBackend gives the same greedy tokens as `stock` on the
torch reference backend. Under the CPU interpreter the run is kept small; on a GPU it is larger
(more questions than streams, so `parallel` batches several requests, and a longer document)."""

import pytest
from checks import ON_GPU

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig

DOCUMENT = "The quick brown fox jumps over the lazy dog near the river bank. "
QUESTIONS = ["What jumps?", "Who is lazy?", "Where is the dog?", "What colour is the fox?",
             "Is there a river?", "How many animals?", "What is near the bank?"]
if ON_GPU:
    MODELS, REPEAT, NUM_QUESTIONS, NEW_TOKENS, STREAMS = ["tiny-gqa", "tiny-odd"], 12, 7, 12, 3
else:
    MODELS, REPEAT, NUM_QUESTIONS, NEW_TOKENS, STREAMS = ["tiny-mha"], 1, 2, 3, None


@pytest.mark.parametrize("model", MODELS)
def test_every_mode_on_triton_matches_torch_stock(model):
    device = "cuda" if ON_GPU else "cpu"
    document, questions = DOCUMENT * REPEAT, QUESTIONS[:NUM_QUESTIONS]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)

    engines = {backend: Engine(f"dummy:{model}", device=device, dtype="float32",
                               config=EngineConfig(attention_backend=backend,
                                                   kv_token_budget=8192, mem_fraction=0.05))
               for backend in ("torch", "triton")}
    assert engines["triton"].config.attention_backend == "triton"

    def tokens(backend: str, mode: str) -> list[list[int]]:
        answers = engines[backend].answer(document, questions, mode=mode, sampling=sampling,
                                          streams=STREAMS if mode == "parallel" else None)
        return [a.token_ids for a in answers]

    expected = tokens("torch", "stock")
    assert all(len(t) == NEW_TOKENS for t in expected)
    assert len({tuple(t) for t in expected}) > 1  # the questions lead to different answers
    for mode in ("stock", "parallel", "cascade"):
        assert tokens("triton", mode) == expected, f"mode {mode} on the Triton backend"


def test_stock_and_cascade_in_one_step_on_triton_match_torch_stock():
    """A session step holding cascade requests (grouped by document) and stock requests (whole
    rows, document hints) together, on the Triton kernels."""
    from ppqa import QuestionRequest

    device = "cuda" if ON_GPU else "cpu"
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    docs = [DOCUMENT * REPEAT, "A second, shorter text about boats. " * REPEAT]
    requests = ([QuestionRequest(("c", i), docs[0], q, sampling) for i, q in enumerate(QUESTIONS[:2])]
                + [QuestionRequest(("s", i), docs[1], q, sampling) for i, q in enumerate(QUESTIONS[2:4])])
    engines = {backend: Engine("dummy:tiny-gqa", device=device, dtype="float32",
                               config=EngineConfig(attention_backend=backend,
                                                   kv_token_budget=8192, mem_fraction=0.05))
               for backend in ("torch", "triton")}
    expected: dict = {}
    engines["torch"].run(requests, mode="stock", on_answer=lambda r, a: expected.__setitem__(r.key, a))

    got: dict = {}
    session = engines["triton"].session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    session.submit(requests[:2], mode="cascade")
    session.submit(requests[2:], mode="stock")
    mixed = False
    while session.has_work():
        running = session.sched.running
        mixed |= {r.mode for r in running} == {"cascade", "stock"}
        session.step()
    session.close()
    assert mixed
    assert {k: a.token_ids for k, a in got.items()} == {k: a.token_ids for k, a in expected.items()}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "split"])
def test_documents_decoding_together_by_either_document_kernel_match_torch_stock(stream,
                                                                                 monkeypatch):
    """Three documents' questions decoding in the same cascade steps, answers of unequal
    budgets (groups shrink and leave), the document part forced through the stream-K kernel
    or through the split one: the tokens of `stock` on the torch backend, and the decode steps
    launched the kernel asked for and never the other."""
    import collections

    from ppqa import QuestionRequest
    from ppqa.engine.attention import triton_backend

    launches = collections.Counter()
    for name in ("launch_stream_prefix", "launch_shared_prefix"):
        def spy(*args, _real=getattr(triton_backend, name), _name=name, **kwargs):
            launches[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(triton_backend, name, spy)
    device = "cuda" if ON_GPU else "cpu"
    docs = [DOCUMENT * REPEAT, "A second, shorter text about boats. " * (2 * REPEAT),
            "Rain fell on the third day, and the town stayed in. " * REPEAT]
    requests = [QuestionRequest((d, i), doc, q, SamplingParams(max_new_tokens=NEW_TOKENS - i,
                                                               ignore_eos=True))
                for d, doc in enumerate(docs) for i, q in enumerate(QUESTIONS[d:d + 2])]
    engines = {backend: Engine("dummy:tiny-gqa", device=device, dtype="float32",
                               config=EngineConfig(attention_backend=backend,
                                                   kv_token_budget=8192, mem_fraction=0.05))
               for backend in ("torch", "triton")}
    engines["triton"].parts.backend.stream_prefix = stream
    answers = {}
    for backend, mode in (("torch", "stock"), ("triton", "cascade")):
        got = answers[backend] = {}
        engines[backend].run(requests, mode=mode,
                             on_answer=lambda r, a, got=got: got.__setitem__(r.key, a.token_ids))
    assert answers["triton"] == answers["torch"]
    used, unused = (("launch_stream_prefix", "launch_shared_prefix") if stream
                    else ("launch_shared_prefix", "launch_stream_prefix"))
    assert launches[used] > 0 and launches[unused] == 0, dict(launches)
