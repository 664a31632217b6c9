"""Triton's CPU interpreter without its repeated patching of ``triton.language`` (test helper).

Imported first by the scripts that run the kernels under ``TRITON_INTERPRET=1``. A kernel launch
patches ``triton.language`` (``tl``, ``tl.core``) for the interpreter and restores it when the launch
ends; the interpreter then patches the same modules again at every call of a ``@triton.jit`` helper
inside the kernel, per program, walking every member of the modules each time -- a tenth of an
interpreted test's time, for patches that are already in place. Here a helper's call skips the
patching when the launch has patched every language module the helper's globals name (else it is
patched as before); what the kernels compute is untouched. Nothing changes where the interpreter's
internals are not the ones this was written against (Triton 3.9).
"""

from __future__ import annotations

from triton.runtime import interpreter as _interpreter

_patched: list[set] = []  # while a launch runs: the ids of the language modules it patched


def _language_modules(fn) -> set:
    found = fn.__dict__.get("_vpce_language_modules")
    if found is None:
        langs = (_interpreter.tl, _interpreter.tl.core)
        found = {id(v) for v in fn.__globals__.values() if any(v is lang for lang in langs)}
        fn.__dict__["_vpce_language_modules"] = found
    return found


def _install() -> None:
    real = _interpreter._patch_lang

    def patch_lang(fn):
        langs = _language_modules(fn)
        if _patched:  # a helper called inside a launch: the launch's scope restores what it patched
            if langs <= _patched[0]:
                return _interpreter._LangPatchScope()
            _patched[0] |= langs
            return real(fn)
        scope = real(fn)
        _patched.append(set(langs))
        restore = scope.restore

        def restore_and_end():
            _patched.clear()
            restore()

        scope.restore = restore_and_end
        return scope

    _interpreter._patch_lang = patch_lang


if hasattr(_interpreter, "_patch_lang") and hasattr(_interpreter, "_LangPatchScope"):
    _install()
