"""Kernel tests run under Triton's interpreter on a machine without a GPU.

tests/conftest.py sets TRITON_INTERPRET=1 first; this repeats it (setdefault) in case these tests
are run on their own. On a machine with an NVIDIA driver the variable is left alone, so the
same tests compile real kernels there.
"""

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
