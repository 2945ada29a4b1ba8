"""GPU-only tests: skipped without CUDA. They reuse the kernel tests' input builders."""

import os
import sys

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
