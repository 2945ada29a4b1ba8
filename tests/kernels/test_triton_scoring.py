"""Choices scored through the Triton backend: the tree-shaped rows (document, question shared
with stream id -1, one stream per choice) and the cascade prefill of per-choice requests give
the log-probabilities of `stock` on the torch reference backend. Under the CPU interpreter the
run is kept small; on a GPU the document is longer and there are more questions."""

import torch
from checks import ON_GPU

from ppqa import Engine
from ppqa.config import EngineConfig

DOCUMENT = "The quick brown fox jumps over the lazy dog near the river bank. "
QUESTIONS = ["What jumps?", "Who is lazy?", "Where is the dog?", "Is there a river?"]
CHOICES = [["the fox", "a dog", "nothing at all"], ["A", "B"], ["by the river", "in town"],
           ["yes", "no", "maybe not"]]
REPEAT, COUNT = (12, 4) if ON_GPU else (1, 2)


def test_scoring_on_triton_matches_torch_stock():
    device = "cuda" if ON_GPU else "cpu"
    engines = {backend: Engine("dummy:tiny-gqa", device=device, dtype="float32",
                               config=EngineConfig(attention_backend=backend,
                                                   kv_token_budget=8192, mem_fraction=0.05))
               for backend in ("torch", "triton")}
    document = DOCUMENT * REPEAT

    def logprobs(backend: str, mode: str) -> torch.Tensor:
        answers = engines[backend].score(document, QUESTIONS[:COUNT], CHOICES[:COUNT], mode=mode)
        return torch.tensor([lp for a in answers for lp in a.choice_logprobs])

    expected = logprobs("torch", "stock")
    for mode in ("parallel", "cascade", "stock"):
        torch.testing.assert_close(logprobs("triton", mode), expected, rtol=1e-4, atol=1e-4,
                                   msg=f"mode {mode} on the Triton backend")


def test_samples_sharing_their_question_on_triton_match_torch_stock():
    """A question's samples in one parallel row behind the question they share (stream -1
    after the document), decoded on the Triton kernels: the tokens of torch `stock`."""
    from ppqa import QuestionRequest, SamplingParams

    device = "cuda" if ON_GPU else "cpu"
    engines = {backend: Engine("dummy:tiny-gqa", device=device, dtype="float32",
                               config=EngineConfig(attention_backend=backend,
                                                   kv_token_budget=8192, mem_fraction=0.05))
               for backend in ("torch", "triton")}
    sampling = SamplingParams(max_new_tokens=3, temperature=1.5, seed=4, ignore_eos=True)
    requests = [QuestionRequest(i, DOCUMENT * REPEAT, q, sampling, samples=3)
                for i, q in enumerate(QUESTIONS[:COUNT])]

    def tokens(backend: str, mode: str) -> dict:
        got = {}
        engines[backend].run(requests, mode=mode, streams=3 if mode == "parallel" else None,
                             on_answer=lambda r, a: got.__setitem__((r.key, a.sample),
                                                                    a.token_ids))
        return got

    expected = tokens("torch", "stock")
    assert len(expected) == 3 * COUNT
    assert tokens("triton", "parallel") == expected
