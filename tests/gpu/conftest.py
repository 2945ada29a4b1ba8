"""GPU-only tests: skipped without CUDA (their pure-Python neighbours live in the CPU files)."""

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
