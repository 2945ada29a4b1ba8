"""ppqa's home folder, defined once: `$PPQA_HOME`, else the platform's user data folder.

The default store (`ppqa.db`), the model cache (`models/`) and the tokenizers saved from GGUF
files (`tokenizers/`, engine/loading/gguf.py) live under it.
"""

from __future__ import annotations

import os
from pathlib import Path


def ppqa_home() -> Path:
    """`$PPQA_HOME`, else the user data folder for "ppqa" (`~/.local/share/ppqa` on Linux)."""
    home = os.environ.get("PPQA_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs  # only the default location needs it

    return Path(platformdirs.user_data_dir("ppqa", appauthor=False))
