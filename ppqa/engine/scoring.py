"""Questions with choices in a session: their streams, and their answers once scored.

    QuestionRequest with choices -> `question_stream` (one stream holding every choice)
    -> `streams_for_mode`: `parallel` (and `auto`) keep it whole: one request per question,
       its choices side by side in the row behind the shared question (runtime/scoring.py);
       `stock` and `cascade` split it into one request per choice, the question forwarded
       with each (cascade prefills them grouped by document). A question whose choices are
       all one token is one request in every mode: its question's last logits score them all.
    -> the session's scoring step -> `ScoreBook.add` per stream -> the question's answers
       when all its choices are in: the best choice by the question's `choice_norm`
       (ppqa/choices.py), every choice's summed log-probability and its probability; or, for
       a question of N samples, N answers whose choices are drawn from that one scoring at
       the question's temperature (`choices.draw_choices`, seeded per sample).
Every mode computes each choice's log-probability from the same tokens at the same positions,
so they agree to float rounding (and so do the draws, but for a uniform that lands within
rounding of a boundary between two choices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppqa.choices import choice_probabilities, draw_choices, normalise
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
    seed: int = 0  # the question's seed: its samples' draws (unused for one answer)


@dataclass
class ScoreBook:
    """Questions being scored, by request: their choices' log-probabilities as they arrive."""

    pending: dict[int, tuple[QuestionRequest, _Pending]] = field(default_factory=dict)

    def expect(self, req: QuestionRequest, choices: ChoiceTokens, prompt_tokens: int,
               seed: int = 0) -> None:
        self.pending[id(req)] = (req, _Pending(choices, [None] * len(choices.ids),
                                               prompt_tokens=prompt_tokens, seed=seed))

    def drop(self, doomed) -> None:
        """Forget the questions that `doomed(request)` picks (cancelled)."""
        for key in [k for k, (req, _) in self.pending.items() if doomed(req)]:
            del self.pending[key]

    def add(self, stream: Stream, logprobs: list[float], *, mode: str, latency_s: float
            ) -> list[Answer]:
        """Record a scored stream; the question's answers (one per sample) once every choice
        is scored, else none."""
        entry = self.pending.get(id(stream.key))
        if entry is None:
            return []
        req, pending = entry
        for i, lp in zip(stream.choice_index, logprobs):
            pending.logprobs[i] = lp
        pending.prefill_s += stream.prefill_s
        if any(lp is None for lp in pending.logprobs):
            return []
        del self.pending[id(stream.key)]
        return _answers(req, pending, mode, latency_s)


def _answers(req: QuestionRequest, pending: _Pending, mode: str, latency_s: float
             ) -> list[Answer]:
    """The best choice, or a drawn one per sample; each with every choice's scores. The
    samples share the one scoring, so each is charged its share of the prefill."""
    choices, labels = pending.choices, req.choices
    logprobs = [float(lp) for lp in pending.logprobs]
    scores = [normalise(lp, len(ids), len(text), req.choice_norm)
              for lp, ids, text in zip(logprobs, choices.ids, choices.texts)]
    probs = choice_probabilities(scores)
    if req.samples == 1:
        picks = [max(range(len(scores)), key=scores.__getitem__)]  # the first of equal scores
    else:
        picks = draw_choices(scores, req.sampling.temperature, pending.seed, req.samples)
    return [Answer(labels[c], list(choices.ids[c]), "choice", pending.prompt_tokens,
                   latency_s=latency_s, mode=mode, streams=1,
                   prefill_s=pending.prefill_s / len(picks), sample=s, choice=labels[c],
                   choices=list(labels), choice_logprobs=logprobs, choice_probs=probs)
            for s, c in enumerate(picks)]
