"""Questions with choices in a session: their streams, and their answers once scored.

    QuestionRequest with choices -> `question_stream` (one stream holding every choice)
    -> `streams_for_mode`: `parallel` (and `auto`) keep it whole: one request per question,
       its choices side by side in the row behind the shared question (runtime/scoring.py);
       `stock` and `cascade` split it into one request per choice, the question forwarded
       with each (cascade prefills them grouped by document). A question whose choices are
       all one token is one request in every mode: its question's last logits score them all.
    -> the session's scoring step -> `ScoreBook.add` per stream -> an `Answer` when all of a
       question's choices are in: the best choice by the question's `choice_norm`
       (ppqa/choices.py), every choice's summed log-probability and its probability.
Every mode computes each choice's log-probability from the same tokens at the same positions,
so they agree to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppqa.choices import choice_probabilities, normalise
from ppqa.engine.loading.tokenizer import ChoiceTokens
from ppqa.engine.outputs import Answer, QuestionRequest
from ppqa.engine.runtime.request import Stream

# What `auto` resolves to for scoring: the cost model is about decode steps, which scoring has
# none of, and the shared question makes `parallel` forward the fewest tokens.
AUTO_SCORING_MODE = "parallel"


def scoring_mode(mode: str) -> str:
    return AUTO_SCORING_MODE if mode == "auto" else mode


def question_stream(req: QuestionRequest, suffix: list[int], choices: ChoiceTokens,
                    doc_len: int) -> Stream:
    """One stream scoring every choice of `req` after its question tokens `suffix`."""
    return Stream(key=req, suffix_ids=list(suffix), sampling=req.sampling, seed=0,
                  prompt_tokens=doc_len + len(suffix), choice_ids=[list(c) for c in choices.ids],
                  choice_index=list(range(len(choices.ids))))


def streams_for_mode(stream: Stream, mode: str) -> list[Stream]:
    """The stream as one (parallel, or single-token choices) or one per choice (see module)."""
    if mode == "parallel" or stream.choice_tokens == 0:
        return [stream]
    return [Stream(key=stream.key, suffix_ids=stream.suffix_ids, sampling=stream.sampling,
                   seed=0, prompt_tokens=stream.prompt_tokens, choice_ids=[ids],
                   choice_index=[i]) for i, ids in zip(stream.choice_index, stream.choice_ids)]


@dataclass
class _Pending:
    choices: ChoiceTokens
    logprobs: list[float | None]
    prefill_s: float = 0.0
    prompt_tokens: int = 0


@dataclass
class ScoreBook:
    """Questions being scored, by request: their choices' log-probabilities as they arrive."""

    pending: dict[int, tuple[QuestionRequest, _Pending]] = field(default_factory=dict)

    def expect(self, req: QuestionRequest, choices: ChoiceTokens, prompt_tokens: int) -> None:
        self.pending[id(req)] = (req, _Pending(choices, [None] * len(choices.ids),
                                               prompt_tokens=prompt_tokens))

    def drop(self, doomed) -> None:
        """Forget the questions that `doomed(request)` picks (cancelled)."""
        for key in [k for k, (req, _) in self.pending.items() if doomed(req)]:
            del self.pending[key]

    def add(self, stream: Stream, logprobs: list[float], *, mode: str, latency_s: float
            ) -> Answer | None:
        """Record a scored stream; the question's Answer once every choice is scored."""
        entry = self.pending.get(id(stream.key))
        if entry is None:
            return None
        req, pending = entry
        for i, lp in zip(stream.choice_index, logprobs):
            pending.logprobs[i] = lp
        pending.prefill_s += stream.prefill_s
        if any(lp is None for lp in pending.logprobs):
            return None
        del self.pending[id(stream.key)]
        return _answer(req, pending, mode, latency_s)


def _answer(req: QuestionRequest, pending: _Pending, mode: str, latency_s: float) -> Answer:
    choices, labels = pending.choices, req.choices
    logprobs = [float(lp) for lp in pending.logprobs]
    scores = [normalise(lp, len(ids), len(text), req.choice_norm)
              for lp, ids, text in zip(logprobs, choices.ids, choices.texts)]
    best = max(range(len(scores)), key=scores.__getitem__)  # the first of equal scores
    return Answer(labels[best], list(choices.ids[best]), "choice", pending.prompt_tokens,
                  latency_s=latency_s, mode=mode, streams=1, prefill_s=pending.prefill_s,
                  choice=labels[best], choices=list(labels), choice_logprobs=logprobs,
                  choice_probs=choice_probabilities(scores))
