"""The engine's modes, defined once: every layer (store, CLI, worker, engine, bench) imports them.

- `stock`: one request per question, the baseline.
- `parallel`: one request per document, its questions as P streams that each see only the
  document and their own tokens (the stream-id mask).
- `cascade`: one request per question; a decode step reads the shared document once for every
  question of its group, then each question's own tokens.
- `auto`: the cost model picks one of the three for the work at hand.
"""

from __future__ import annotations

ENGINE_MODES = ("stock", "parallel", "cascade")
MODES = ("auto", *ENGINE_MODES)


def check_mode(mode: str, what: str = "mode") -> str:
    """`mode` if it is one of MODES, else ValueError naming the choices."""
    if mode not in MODES:
        raise ValueError(f"unknown {what} {mode!r}; choose one of {', '.join(MODES)}")
    return mode
