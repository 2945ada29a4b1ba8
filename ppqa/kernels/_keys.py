"""Triton cache keys computed once per process, helpers before the kernels that call them.

A JIT function's cache key covers its source, the keys of the functions it calls and the
constexpr globals (`LN2`, `NEG_BIG`) that it and they read. Triton 3.6 adds a callee's globals
to the caller's key only when the callee's own key was computed earlier in the process (its
`DependenciesFinder._update_hash` merges `used_global_vals` before asking for `cache_key`;
3.9 asks first). So a kernel's key there depended on what the process had compiled before: a
compile helper whose first kernel was the decode kernel stored it under one key, a worker that
had met the merge kernel first looked it up under another, and compiled the same binary again
(results/h200/preload_check_layout_jitkeys_s18c8.json: the decode and extend kernels, the
helpers' keys without `LN2`, the worker's with it). Each kernel module ends by settling its own
functions' keys in definition order, after the modules it imports have settled theirs, so every
process holds the same keys whatever it compiles first.
"""

from __future__ import annotations


def settle_cache_keys(namespace: dict) -> None:
    """Compute the cache key of every Triton JIT function defined in the module whose globals
    are `namespace`, in definition order (callees first). Under the interpreter
    (TRITON_INTERPRET=1) there are no JIT functions and nothing to do."""
    from triton.runtime.jit import JITFunction

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.__module__ == namespace["__name__"]:
            value.cache_key  # noqa: B018 - computed and kept by Triton: that is the point
