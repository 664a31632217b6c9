"""Fresh Python processes that do not import torch again (test helper).

A Python that imports torch spends seconds of a 2-core machine doing so, and the suite starts dozens
of them: gloo ranks (tests/dist.py), scripts run under Triton's interpreter, the benchmarks' smoke
runs. Here they are forked from one server per test process that imported torch once
(multiprocessing's ``forkserver`` with torch preloaded) -- and nothing else: triton and vparallel_ce,
which read environment variables at import (``TRITON_INTERPRET``, ``VPARALLEL_CE_KERNELS``), are
imported by each process after its own environment is set, as in a new interpreter.

* :func:`context`: the multiprocessing context of those processes (tests/dist.py's ranks);
* :func:`run_python`: ``python -c CODE ARGS``, ``python -m MODULE ARGS`` or ``python FILE ARGS`` with an
  environment and a working directory, returning what ``subprocess.run(..., capture_output=True, text=True)`` does,
  and raising ``subprocess.TimeoutExpired`` (after killing the process and its children) past the
  timeout. Where the server holds a module it must not (some torch build imports triton itself),
  the command runs in a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile

PRELOAD = ["torch"]
_IMPORTED_AFTER_THE_ENVIRONMENT = ("triton", "vparallel_ce")
_FRESH_INTERPRETER_NEEDED = 75  # the forked process's exit code when the server imported one of them


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _python(kind: str, what: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    import atexit
    import runpy

    os.setsid()  # its own process group: killed with its children on a timeout
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    if any(name in sys.modules for name in _IMPORTED_AFTER_THE_ENVIRONMENT):
        os._exit(_FRESH_INTERPRETER_NEEDED)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # as a new interpreter's sys.path: the file's directory (-c: the working directory's "", -m: the
    # working directory), then PYTHONPATH, then the rest
    first = {"-c": "", "-m": cwd}.get(kind, os.path.dirname(os.path.abspath(what)))
    sys.path[:0] = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    try:
        if kind == "-c":
            sys.argv = ["-c", *argv]
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif kind == "-m":
            sys.argv = [what, *argv]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [what, *argv]
            runpy.run_path(what, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def run_python(kind: str, what: str, *argv: str, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``python KIND WHAT ARGV`` (``kind``: ``"-c"``, ``"-m"``, or ``""`` for ``python FILE``) in a
    process forked from the torch-preloaded server, with exactly ``env`` as its environment."""
    args = [sys.executable, *([kind] if kind else []), str(what), *argv]
    with tempfile.TemporaryDirectory(prefix="vpce_warm_") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out, err):
            open(path, "w").close()
        proc = context().Process(target=_python, args=(kind, str(what), list(argv), dict(env), str(cwd), out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join(5)
            raise subprocess.TimeoutExpired(args, timeout, _read(out), _read(err))
        if proc.exitcode == _FRESH_INTERPRETER_NEEDED:
            return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(args, proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()
