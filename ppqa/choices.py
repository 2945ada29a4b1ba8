"""Questions answered by choosing one of a set of options: the checks and the arithmetic.

A question may carry `choices` (labels such as "yes", "no", "unsure", or the options of a
multiple-choice question). The engine scores each choice by the log-probability of its tokens
after the document and the question (engine/scoring.py) and the answer is the best one. This
module is what the input checks, the store and the engine share, without torch:

- `check_choices`: at least two distinct, non-empty labels (ValueError naming the problem);
- `CHOICE_NORMS` and `normalise`: how summed log-probabilities are compared, as
  lm-evaluation-harness's `acc` (none: the sum) and `acc_norm` (char: the sum divided by the
  choice's characters), plus token (the mean per token);
- `choice_probabilities`: the softmax of the normalised scores over the choices, so that the
  probabilities of a question's choices add up to 1 and the chosen one has the highest.
- `draw_choices`: a question's samples (`--samples N` at a temperature T > 0), drawn from the
  one scoring: P(choice) proportional to exp(score / T), sample s seeded by
  `config.sample_seed(seed, s)` as a generated sample is, so a draw depends on its seed and
  the scores alone (not on the batch, the mode or the other samples).
- `vote`: the most frequent of a question's drawn choices and its share of the draws.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

from ppqa.config import sample_seed

CHOICE_NORMS = ("none", "token", "char")
MAX_CHOICES = 256  # a label set, not a vocabulary


def check_choices(choices: Sequence[str]) -> tuple[str, ...]:
    """The choices as a tuple; ValueError for fewer than two, an empty or blank one, a
    duplicate, or more than MAX_CHOICES."""
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a list of strings, got {choices!r}")
    out = tuple(choices)
    if any(not isinstance(c, str) for c in out):
        raise ValueError(f"choices must be strings, got {list(out)!r}")
    if len(out) < 2:
        raise ValueError(f"give at least two choices, got {len(out)}"
                         + (f" ({out[0]!r})" if out else ""))
    if len(out) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices, got {len(out)}")
    seen: set[str] = set()
    for c in out:
        if not c.strip():
            raise ValueError("a choice is empty")
        if c in seen:
            raise ValueError(f"duplicate choice {c!r}")
        seen.add(c)
    return out


def check_norm(norm: str) -> str:
    if norm not in CHOICE_NORMS:
        raise ValueError(f"choice_norm must be one of {', '.join(CHOICE_NORMS)}, got {norm!r}")
    return norm


def normalise(logprob: float, num_tokens: int, num_chars: int, norm: str) -> float:
    """The score a choice is compared by: its summed log-probability (none), per token
    (token) or per character of the scored text (char)."""
    if check_norm(norm) == "token":
        return logprob / max(num_tokens, 1)
    if norm == "char":
        return logprob / max(num_chars, 1)
    return logprob


def score_records(labels: Sequence[str], logprobs: Sequence[float], probs: Sequence[float]
                  ) -> list[dict]:
    """[{"choice", "logprob", "prob"}] per choice, in the question's order: what the store
    keeps and the export writes."""
    return [{"choice": c, "logprob": float(lp), "prob": float(p)}
            for c, lp, p in zip(labels, logprobs, probs, strict=True)]


def choice_probabilities(scores: Sequence[float]) -> list[float]:
    """exp(score_i) / sum_j exp(score_j), computed stably."""
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def draw_probabilities(scores: Sequence[float], temperature: float) -> list[float]:
    """The distribution samples are drawn from: exp(score_i / T) / sum_j exp(score_j / T). A low
    temperature sharpens it towards the best choice, a high one flattens it."""
    if not temperature > 0:
        raise ValueError(f"drawing choices needs a temperature above 0, got {temperature!r}")
    return choice_probabilities([s / temperature for s in scores])


def draw_choice(probabilities: Sequence[float], seed: int) -> int:
    """The index of one choice drawn from `probabilities` by one uniform of `seed`: the first
    choice whose cumulative probability passes it. Python's `Random(seed).random()` is
    documented to give the same number on every version, so a stored draw can be redrawn."""
    uniform = random.Random(seed).random()
    cumulative = 0.0
    for i, p in enumerate(probabilities):
        cumulative += p
        if uniform < cumulative:
            return i
    # The sum fell short of 1 by rounding and the uniform lies in that sliver.
    return max(i for i, p in enumerate(probabilities) if p > 0)


def draw_choices(scores: Sequence[float], temperature: float, seed: int, samples: int
                 ) -> list[int]:
    """The choice of each of a question's `samples` (see the module doc)."""
    probabilities = draw_probabilities(scores, temperature)
    return [draw_choice(probabilities, sample_seed(seed, s)) for s in range(samples)]


def vote(drawn: Sequence[str], records: Sequence[dict]) -> tuple[str, float]:
    """(the label drawn most often, its share of `drawn`) for one question's samples;
    `records` are its `score_records`. A tie goes to the label of higher probability, then to
    the one listed first among the question's choices."""
    if not drawn:
        raise ValueError("a vote needs at least one drawn choice")
    counts = Counter(drawn)
    rank = {r["choice"]: (r["prob"], -i) for i, r in enumerate(records)}
    unknown = (float("-inf"), -len(records))  # a label the scores lack loses every tie
    best = max(counts, key=lambda label: (counts[label], *rank.get(label, unknown)))
    return best, counts[best] / len(drawn)
