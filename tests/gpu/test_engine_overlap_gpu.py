"""The step in flight on a GPU (CUDA graphs, input tokens gathered on the device from the
previous step's samples): answers with EOS, stop strings and short budgets equal those of
step-by-step runs, in every mode (tests/test_engine_overlap.py runs the same on the CPU)."""

import random

import pytest
import torch

from ppqa import Engine, QuestionRequest, SamplingParams
from ppqa.config import EngineConfig
from tests.helpers import answers_by_key, overlap_workload, plain_template

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("mode,streams", [("stock", None), ("cascade", None), ("parallel", 4)])
def test_step_in_flight_on_the_gpu(mode, streams, tmp_path):
    tmpl = plain_template(tmp_path)
    requests = overlap_workload(random.Random(mode), tmpl)
    engines = {overlap: Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                               config=EngineConfig(seed=3, overlap_steps=overlap, mem_fraction=0.05))
               for overlap in (True, False)}
    eight_tokens = SamplingParams(max_new_tokens=8, ignore_eos=True)
    probe = answers_by_key(engines[False], [QuestionRequest(r.key, r.document, r.question,
                                                            eight_tokens, tmpl) for r in requests],
                           mode="stock")
    firsts = [ids[1] for ids, _, _ in probe.values() if len(ids) > 2]
    eos = max(set(firsts), key=firsts.count)  # a token some answers emit early
    for eng in engines.values():
        eng.tokenizer.eos_token_ids = [eos]
    reference = answers_by_key(engines[False], requests, mode=mode, streams=streams)
    assert answers_by_key(engines[True], requests, mode=mode, streams=streams) == reference
    assert "stop" in {reason for _, reason, _ in reference.values()}


def test_time_charged_on_the_gpu_fits_in_the_session(tmp_path):
    """Document chunks and question prefills queued between decode steps, prefill and decode
    both charged by device events: every answer is charged decode time, the long document's
    questions prefill time, and together the charges stay within the session's wall time. (A
    tiny model's steps are too short for this to catch a small double count; the e2e reports'
    `worker_s`, run less prefill and decode, is where one shows as a negative.)"""
    import time

    from tests.helpers import text

    eng = Engine("dummy:tiny-gqa", device="cuda", dtype="bfloat16",
                 config=EngineConfig(seed=3, mem_fraction=0.05, max_prefill_tokens=256))
    tmpl = plain_template(tmp_path)
    rng = random.Random(7)
    got: dict = {}
    began = time.perf_counter()
    session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, a))
    first = [QuestionRequest(("a", i), text(rng, 40), text(rng, 8),
                             SamplingParams(max_new_tokens=60, ignore_eos=True), tmpl)
             for i in range(4)]
    session.submit(first, mode="stock")
    for _ in range(3):
        session.step()
    long_doc = text(rng, 3000)  # many chunks, prefilled while the first questions decode
    session.submit([QuestionRequest(("b", i), long_doc, text(rng, 8),
                                    SamplingParams(max_new_tokens=4, ignore_eos=True), tmpl)
                    for i in range(3)], mode="stock")
    session.drain()
    session.close()
    wall = time.perf_counter() - began
    assert len(got) == 7 and all(a.decode_s > 0 for a in got.values())
    assert all(a.prefill_s > 0 for k, a in got.items() if k[0] == "b")
    charged = sum(a.prefill_s + a.decode_s for a in got.values())
    assert 0 < charged <= wall, (charged, wall)


def test_a_gpu_engine_makes_the_libraries_first_use_while_its_model_builds():
    """engine/first_use.py: Triton's runtime, cuBLAS and cuDNN are first used on a thread
    beside the model's building, which has ended (joined) when the KV pool is sized; the
    engine then answers as ever. An fp32 engine leaves out cuDNN's attention, which takes no
    fp32; a CPU engine starts no thread."""
    eng = Engine("dummy:tiny-hd128", device="cuda", dtype="bfloat16",
                 config=EngineConfig(mem_fraction=0.05))
    first = eng.parts.first_use
    assert first.thread is None
    assert set(first.seconds) == {"triton", "cublas", "torch_ops", "cudnn"}
    assert not {"triton", "cublas", "torch_ops"} & set(first.errors), first.errors
    got = eng.answer("a short document about first uses", ["what?"],
                     sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(got) == 1 and got[0].token_ids
    fp32 = Engine("dummy:tiny-hd128", device="cuda", dtype="float32",
                  config=EngineConfig(mem_fraction=0.05)).parts.first_use
    assert set(fp32.seconds) == {"triton", "cublas", "torch_ops"} and not fp32.errors, \
        fp32.errors
    cpu = Engine("dummy:tiny-gqa", device="cpu").parts.first_use
    assert cpu.seconds == {} and cpu.thread is None
    from ppqa.engine import first_use

    ahead = first_use.prepare(torch.device("cuda"))  # Triton's own key, hashed on a thread
    assert ahead is not None
    ahead.join()
    assert first_use.triton_key() is not None


def test_a_gpu_engine_does_its_host_bookkeeping_on_one_thread():
    """Intra-op threads only make the host's small ops wait for cores the tokenizer's pool
    holds (benchmarks/host_threads.py); a GPU engine sets one, a CPU engine leaves torch's."""
    torch.set_num_threads(2)
    Engine("dummy:tiny-gqa", device="cpu")
    assert torch.get_num_threads() == 2
    Engine("dummy:tiny-gqa", device="cuda", config=EngineConfig(mem_fraction=0.05))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("mode,streams", [("stock", None), ("cascade", None), ("parallel", 4)])
def test_documents_prefilled_ahead_on_the_gpu_give_the_same_tokens(mode, streams, tmp_path):
    """`prefill_ahead` between an idle session's submits (a worker's first claims) launches
    the documents' chunks behind one another without waiting; CUDA graphs and the step in
    flight then give every answer the token ids of the same submits without it (fp32)."""
    tmpl = plain_template(tmp_path)
    requests = overlap_workload(random.Random(f"ahead-{mode}"), tmpl)
    by_doc: dict = {}
    for r in requests:
        by_doc.setdefault(r.document, []).append(r)

    def run(ahead: bool) -> dict:
        eng = Engine("dummy:tiny-gqa", device="cuda", dtype="float32",
                     config=EngineConfig(seed=3, mem_fraction=0.05, max_prefill_tokens=128))
        got: dict = {}
        session = eng.session(on_answer=lambda r, a: got.__setitem__(r.key, (a.token_ids,
                                                                             a.finish_reason)))
        launched = []
        for batch in by_doc.values():
            session.submit(batch, mode=mode, streams=streams, background=True)
            if ahead:
                launched.append(session.prefill_ahead())
        while session.has_work():
            session.step()
        session.close()
        assert all(launched)
        return got

    plain = run(False)
    assert run(True) == plain and len(plain) == len(requests)
