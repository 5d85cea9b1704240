"""A faster Triton interpreter for the suite, same semantics.

Triton's interpreter (``TRITON_INTERPRET=1``) patches ``triton.language`` into its numpy
versions when a kernel launches (``GridExecutor.__call__``) and restores it when the grid
ends.  It also re-runs the whole patch -- ``inspect.getmembers`` over ``tl``, ``tl.core``,
``tl.math`` and the tensor class -- on every call of a nested ``@triton.jit`` function, and
drops that scope unrestored.  After the first such call of a launch the repeats change
nothing.  dspec's kernels call ``tl.sum``, ``tl.max``, ``tl.zeros`` (jit functions of
``triton.language.standard``) per tile, so the repeats were about half of the interpreter's
time: one ``verify_chain`` on 8 x 6 x 53 logits, sampling, ran 2.3 s with them and 1.0 s
without, with equal outputs.

``skip_nested_repatching`` makes a nested helper's patch a no-op where the running launch
has already patched every language module the helper sees (by its own patch or an earlier
helper's); anything else (a launch, the first helper to see a module, a Triton without
these internals) runs Triton's own code.
"""

from __future__ import annotations

import functools
import inspect


def skip_nested_repatching() -> bool:
    """Installs the shortcut; returns whether it could (False leaves Triton untouched)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None or getattr(patch_lang, "_dspec_shortcut", False):
        return False
    # per running launch (innermost last): its kernel fn and the language modules patched
    # since it started -- its own, then those of the helpers it called (a helper of
    # triton.language.standard sees tl.core where the kernel sees tl)
    launches = []

    @functools.lru_cache(maxsize=None)
    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch(fn):
        if launches and fn is not launches[-1][0]:
            langs, patched = langs_of(fn), launches[-1][1]
            if langs <= patched:
                return scope_type()  # patched earlier in this launch
            patched |= langs
        return patch_lang(fn)

    patch._dspec_shortcut = True
    launch = executor.__call__

    def call(self, *args, **kwargs):
        launches.append((self.fn, set(langs_of(self.fn))))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch
    executor.__call__ = call
    return True
