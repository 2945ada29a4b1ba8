"""Decode steps replayed from CUDA graphs give the same tokens as eager steps, in every mode,
across several length buckets (new captures mid-run) and batch sizes (requests finishing).
The buckets themselves are tested on the CPU (tests/test_graph_buckets.py)."""

import pytest
import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-mha"])
def test_graph_replay_matches_eager_in_every_mode(model):
    document = "Rivers carry silt to the delta, where the town of Mere was built. " * 6
    questions = [f"What happened in year {i}?" * (1 + i % 3) for i in range(11)]
    budgets = [40 + 9 * i for i in range(len(questions))]  # requests finish at different steps
    engines = {g: Engine(f"dummy:{model}", device="cuda", dtype="float32",
                         config=EngineConfig(cuda_graphs=g, mem_fraction=0.05)) for g in (False, True)}
    assert engines[True].parts.runner.graphs is not None
    assert engines[False].parts.runner.graphs is None
    for mode in ("stock", "parallel", "cascade"):
        got = {}
        for g, eng in engines.items():
            from ppqa import QuestionRequest
            out = {}
            eng.run([QuestionRequest(i, document, q, SamplingParams(max_new_tokens=b, ignore_eos=True))
                     for i, (q, b) in enumerate(zip(questions, budgets))], mode=mode,
                    streams=4 if mode == "parallel" else None,
                    on_answer=lambda r, a: out.__setitem__(r.key, a.token_ids))
            got[g] = [out[i] for i in range(len(questions))]
        assert got[True] == got[False], mode
    # Shapes used often were captured (buckets and batch sizes); passing ones ran eagerly.
    assert engines[True].captured_graphs >= 4


def test_warmup_captures_the_full_batch_graphs_before_any_work():
    """After `warmup`, a full step of new questions by cascade on the long warm-up document
    and by stock on the short one replays graphs captured during the warm-up: none is new."""
    from ppqa.engine.engine import _synthetic_text

    config = EngineConfig(mem_fraction=0.05, max_batch_requests=32, max_prefill_tokens=512)
    eng = Engine("dummy:tiny-gqa", device="cuda", config=config)
    eng.warmup()
    captured = eng.captured_graphs
    assert captured > 0
    questions = [f"What happened on day {31 - i}?" for i in range(32)]  # warm-up's lengths
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
    long = _synthetic_text(eng.tokenizer, 512 + 64)
    short = _synthetic_text(eng.tokenizer, 150)
    cascade = eng.answer(long, questions, mode="cascade", sampling=sampling)
    stock = eng.answer(short, questions, mode="stock", sampling=sampling)
    assert all(len(a.token_ids) == 4 for a in cascade + stock)
    assert eng.captured_graphs == captured


def test_steps_mixing_stock_and_cascade_replay_like_eager():
    """One session, two documents: one's questions by cascade, the other's by stock, decoded
    side by side in the same steps (width-1 requests of both modes), answers of different
    lengths so the mix changes as requests finish. With graphs, those mixed steps are
    captured and replayed, and every token is the eager run's (fp32)."""
    from ppqa import QuestionRequest

    cascade_doc = "The harbor of Velm opened in 1901; its three piers face north. " * 8
    stock_doc = "Orrin is a river town with two bridges and a market on Sundays. " * 5
    requests = [(QuestionRequest(("c", i), cascade_doc, f"Which pier is number {i}?",
                                 SamplingParams(max_new_tokens=30 + 7 * i, ignore_eos=True)),
                 "cascade") for i in range(9)]
    requests += [(QuestionRequest(("s", i), stock_doc, f"Which bridge is number {i}?",
                                  SamplingParams(max_new_tokens=25 + 11 * i, ignore_eos=True)),
                  "stock") for i in range(5)]
    got = {}
    for graphs in (False, True):
        eng = Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                     config=EngineConfig(cuda_graphs=graphs, mem_fraction=0.05))
        out, mixed = {}, []
        session = eng.session(on_answer=lambda r, a: out.__setitem__(r.key, a.token_ids))
        build = session.sched.decode_step

        def logged(batch, build=build, mixed=mixed, **kw):
            mixed.append({r.mode for r in batch if r.row >= 0} == {"cascade", "stock"})
            return build(batch, **kw)

        session.sched.decode_step = logged
        for mode in ("cascade", "stock"):
            session.submit([r for r, m in requests if m == mode], mode=mode)
        session.drain()
        session.close()
        assert sum(mixed) >= 10  # most steps hold both modes
        got[graphs] = out
        if graphs:
            assert eng.captured_graphs > 0
    assert got[True] == got[False]
    assert len(got[True]) == len(requests)


def _engine(model: str, graphs: bool) -> Engine:
    return Engine(f"dummy:{model}", device="cuda", dtype="float32",
                  config=EngineConfig(cuda_graphs=graphs, mem_fraction=0.05))


def _answers(eng, document, questions):
    from ppqa import QuestionRequest

    out = {}
    eng.run([QuestionRequest(i, document, q, SamplingParams(max_new_tokens=24 + 5 * i,
                                                              ignore_eos=True))
             for i, q in enumerate(questions)], mode="cascade",
            on_answer=lambda r, a: out.__setitem__(r.key, a.token_ids))
    return [out[i] for i in range(len(questions))]


def test_a_capture_does_not_wait_for_the_work_queued_before_it(monkeypatch):
    """A graph captured mid-run is recorded behind the device's queue: ~0.25 s of GPU work
    queued just before each capture is still running when the capture returns (the old path,
    `torch.cuda.graph`, synchronized the device first). The tokens are the eager run's."""
    from ppqa.engine.runtime.graph_runner import GraphCache

    document = "The ferry to Aske leaves at dawn and returns at dusk. " * 7
    questions = [f"When does ferry {i} leave?" for i in range(6)]
    eager = _answers(_engine("tiny-gqa", graphs=False), document, questions)
    capture, busy = GraphCache._capture, []

    def behind_a_queue(self, key, input_ids, meta):
        torch.cuda._sleep(500_000_000)  # ~0.25 s of one SM's cycles, on the current stream
        queued = torch.cuda.Event()
        queued.record()
        step = capture(self, key, input_ids, meta)
        busy.append(not queued.query())
        return step

    monkeypatch.setattr(GraphCache, "_capture", behind_a_queue)
    eng = _engine("tiny-gqa", graphs=True)
    assert _answers(eng, document, questions) == eager
    assert eng.captured_graphs == len(busy) > 0
    assert all(busy), busy
    assert eng.parts.runner.graphs.sync_captures == 0


def test_a_failed_capture_is_captured_again_the_synchronizing_way(monkeypatch):
    """Where the queued capture raises (the graph pool could not grow without a synchronize),
    the step is captured through `torch.cuda.graph` and replays like the eager step. The
    failure is injected: a full graph pool cannot be produced on demand."""
    from ppqa.engine.runtime.graph_runner import GraphCache

    document = "Kettle Lake freezes in December; skaters cross it in January. " * 6
    questions = [f"Which month is number {i}?" for i in range(5)]
    eager = _answers(_engine("tiny-mha", graphs=False), document, questions)
    forward, failed = GraphCache._forward, []

    def fail_first(self, input_ids, meta):
        if torch.cuda.is_current_stream_capturing() and not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("injected: the graph pool cannot grow")
        return forward(self, input_ids, meta)

    monkeypatch.setattr(GraphCache, "_forward", fail_first)
    eng = _engine("tiny-mha", graphs=True)
    assert _answers(eng, document, questions) == eager
    assert failed and eng.parts.runner.graphs.sync_captures == 1
    assert eng.captured_graphs >= 2
