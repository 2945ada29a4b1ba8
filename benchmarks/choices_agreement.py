"""Scored choices against generated answers: does the label ppqa picks by log-probability match
what the model writes when asked to answer freely? SmolLM2 on the bundled examples, on the CPU.

For each template (`label`, `multiple_choice`, `judge`) and each question of the examples
(`examples/labels.csv` with its choices; `examples/judge.jsonl` with yes/no), the question is
answered twice by the same engine, after its document is cached: `Engine.score` (one forward,
no generation) and `Engine.answer` (greedy, a few tokens, same template, the options written
into the question as the template lists choices, so both see the same prompt). A generated answer "agrees" when the
first choice it names (a label, or for multiple choice the letter) is the scored one; it
"names none" when it names no choice at all. Writes counts, per-question rows and the wall
time of each way to --out.

    .venv/bin/python benchmarks/choices_agreement.py --out benchmarks/results/cpu/choices_agreement.json
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import time
from pathlib import Path

from ppqa import Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
LETTERS = "ABCDEFGHIJ"


def first_named(text: str, labels: list[str], letters: bool) -> int | None:
    """Index of the first choice the generated text names, or None."""
    if letters:
        match = re.search(r"\b([A-J])\b", text)
        if match and LETTERS.index(match.group(1)) < len(labels):
            return LETTERS.index(match.group(1))
        return None
    low = text.lower()
    hits = [(low.find(label.lower()), i) for i, label in enumerate(labels) if label.lower() in low]
    return min(hits)[1] if hits else None


def _options(template: str, labels: list[str]) -> str:
    """The options as the built-in template renders a question's choices (ppqa/templates)."""
    if template == "multiple_choice":
        return "".join(f"\n{LETTERS[i]}. {label}" for i, label in enumerate(labels))
    if template == "judge":
        return f"\nReply with one of: {', '.join(labels)}."
    return f"\nLabels: {', '.join(labels)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8, help="generated tokens per answer")
    ap.add_argument("--out", default="choices_agreement.json")
    args = ap.parse_args()
    document = (ROOT / "examples" / "harrowmere.txt").read_text()
    with open(ROOT / "examples" / "labels.csv", newline="") as f:
        labelled = [(row["question"], row["choices"].split("|")) for row in csv.DictReader(f)]
    judged = [(json.loads(line)["question"], ["yes", "no"])
              for line in (ROOT / "examples" / "judge.jsonl").read_text().splitlines() if line]
    sets = {"label": labelled, "multiple_choice": labelled, "judge": judged}
    engine = Engine(args.model, device="cpu")
    sampling = SamplingParams(max_new_tokens=args.tokens)
    result = {"model": args.model, "tokens": args.tokens, "templates": {}}
    for template, items in sets.items():
        questions, choices = [q for q, _ in items], [c for _, c in items]
        # The template's document prefix cached first, so neither way pays its prefill.
        engine.answer(document, ["?"], sampling=SamplingParams(max_new_tokens=1), template=template)
        t0 = time.perf_counter()
        scored = engine.score(document, questions, choices, template=template)
        score_s = time.perf_counter() - t0
        # Generation sees the options exactly as the template lists a question's choices.
        shown = [q + _options(template, c) for q, c in zip(questions, choices)]
        t0 = time.perf_counter()
        generated = engine.answer(document, shown, sampling=sampling, template=template)
        answer_s = time.perf_counter() - t0
        rows, agree, none = [], 0, 0
        for q, labels, s, g in zip(questions, choices, scored, generated):
            named = first_named(g.text, labels, template == "multiple_choice")
            chosen = labels.index(s.choice)
            agree += named == chosen
            none += named is None
            rows.append({"question": q, "scored": s.choice,
                         "prob": round(max(s.choice_probs), 3), "generated": g.text,
                         "generated_names": None if named is None else labels[named]})
        result["templates"][template] = {"questions": len(questions), "agree": agree,
                                         "names_none": none, "score_s": score_s,
                                         "generate_s": answer_s, "rows": rows}
        print(f"{template:16s} agree {agree}/{len(questions)} (names none: {none}); scoring "
              f"{score_s:.2f} s, generating {args.tokens} tokens {answer_s:.2f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
