"""Fresh Python processes that do not import torch again (test helper).

A Python that imports torch spends seconds of a 2-core machine doing so, and the suite starts dozens
of them: gloo ranks (tests/dist.py), scripts run under Triton's interpreter, the benchmarks' smoke
runs. Here they are forked from one server per test process that imported torch once
(multiprocessing's ``forkserver`` with torch preloaded), and DTensor (``torch.distributed.tensor``,
a second more with sympy, which most ranks import: device meshes, DTensor inputs, the trainers) --
and nothing else: triton and vparallel_ce, which read environment variables at import
(``TRITON_INTERPRET``, ``VPARALLEL_CE_KERNELS``), are imported by each process after its own
environment is set, as in a new interpreter (so is ``torch._dynamo``, which imports triton).

* :func:`context`: the multiprocessing context of those processes (tests/dist.py's ranks);
* :func:`run_python`: ``python -c CODE ARGS``, ``python -m MODULE ARGS`` or ``python FILE ARGS`` with
  an environment and a working directory, returning what ``subprocess.run(..., capture_output=True,
  text=True)`` does, and raising ``subprocess.TimeoutExpired`` (after killing the process and its
  children) past the timeout. Where the server holds a module it must not (some torch build imports
  triton itself), the command runs in a new interpreter instead;
* :func:`start_python`: the same started, its output written to files (ranks started together);
  :func:`run_like_torchrun`: the ranks of ``torchrun --nproc_per_node N`` without its agent.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

PRELOAD = ["torch", "torch.distributed.tensor"]
_IMPORTED_AFTER_THE_ENVIRONMENT = ("triton", "vparallel_ce")
# the forked process's exit code when the server imported one of them with other settings than asked
FRESH_INTERPRETER_NEEDED = 75


def _read_at_import(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(("TRITON_", "VPARALLEL_CE_"))}


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _python(kind: str, what: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    import atexit
    import runpy

    os.setsid()  # its own process group: killed with its children on a timeout
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    if (any(name in sys.modules for name in _IMPORTED_AFTER_THE_ENVIRONMENT)
            and _read_at_import(env) != _read_at_import(os.environ)):
        os._exit(FRESH_INTERPRETER_NEEDED)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads != os.environ.get("OMP_NUM_THREADS", ""):
        # OpenMP read the server's setting when torch was loaded: the one asked for, set through torch
        import torch

        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)
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


def start_python(kind: str, what, *argv: str, env: dict, cwd, out, err=None):
    """Start ``python KIND WHAT ARGV`` (``kind``: ``"-c"``, ``"-m"``, or ``""`` for ``python FILE``) in
    a process forked from the torch-preloaded server, with exactly ``env`` as its environment, its
    stdout written to the file ``out`` and its stderr to ``err`` (default: ``out`` too). Returns the
    ``multiprocessing`` process: its own process group (``os.killpg(proc.pid, ...)`` ends it with its
    children), ``exitcode`` as a ``Popen.returncode``; ``exitcode == FRESH_INTERPRETER_NEEDED`` when
    the server imported a module that must come after the environment (then nothing ran)."""
    proc = context().Process(target=_python, args=(kind, str(what), list(argv), dict(env), str(cwd), str(out),
                                                   str(err if err is not None else out)))
    proc.start()
    return proc


def run_python(kind: str, what, *argv: str, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """:func:`start_python`, waited for: what ``subprocess.run(capture_output=True, text=True)``
    returns, or ``subprocess.TimeoutExpired`` once the process and its children are killed."""
    args = [sys.executable, *([kind] if kind else []), str(what), *argv]
    with tempfile.TemporaryDirectory(prefix="vpce_warm_") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = start_python(kind, what, *argv, env=env, cwd=cwd, out=out, err=err)
        proc.join(timeout)
        if proc.exitcode is None:
            kill(proc)
            raise subprocess.TimeoutExpired(args, timeout, _read(out), _read(err))
        if proc.exitcode == FRESH_INTERPRETER_NEEDED:
            return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(args, proc.exitcode, _read(out), _read(err))


def run_like_torchrun(kind: str, what, *argv: str, nproc: int, env: dict, cwd, logdir, timeout: float,
                      port: int) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC [KIND] WHAT ARGV`` on one host, without its agent: the ranks
    with the environment torchrun gives them, started by :func:`start_python`, their output in
    ``logdir``. Returns rank 0's stdout and stderr with the first non-zero exit code of the ranks (the
    failed rank's output added to stderr); past ``timeout``, kills every rank and raises
    ``subprocess.TimeoutExpired``."""
    args = ["torchrun", "--nproc_per_node", str(nproc), *([kind] if kind else []), str(what), *argv]
    logs = [(os.path.join(logdir, f"rank{r}.out"), os.path.join(logdir, f"rank{r}.err")) for r in range(nproc)]
    procs = [start_python(kind, what, *argv, cwd=cwd, out=out, err=err,
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
                               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
             for r, (out, err) in enumerate(logs)]
    finished = join_all(procs, timeout)
    out0, err0 = (_read(path) for path in logs[0])
    if not finished:
        raise subprocess.TimeoutExpired(args, timeout, out0, err0)
    failed = first_failure(procs)
    if failed:
        r, code = failed
        err0 += f"\n--- rank {r} exited {code}:\n{_read(logs[r][0])[-3000:]}\n{_read(logs[r][1])[-6000:]}"
        return subprocess.CompletedProcess(args, code, out0, err0)
    return subprocess.CompletedProcess(args, 0, out0, err0)


def first_failure(procs) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the first of ``procs`` (ended processes, in rank order) that failed by
    itself, before one that was killed for it (a negative code); None where every one exited 0."""
    failed = sorted((p.exitcode < 0, r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0)
    return (failed[0][1], failed[0][2]) if failed else None


def free_port() -> int:
    """A loopback port free now, below the kernel's range of ephemeral ports (where it can tell), so
    that no connection made meanwhile takes it as its local port before the run listens on it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(100 if low > 11000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_all(procs, timeout: float) -> bool:
    """Wait for every process of :func:`start_python`, for ``timeout`` seconds at most. As torchrun's
    agent does, a process that fails ends the others at once (they may wait in a collective for it);
    so does the timeout, and then the answer is False."""
    deadline = time.monotonic() + timeout
    while any(p.exitcode is None for p in procs):
        left = deadline - time.monotonic()
        if left <= 0 or any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                kill(p)
            return left > 0
        mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(left, 1.0))
    return True


def kill(proc) -> None:
    """End a process of :func:`start_python` and every process it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.join(5)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:  # the process ended before it opened its output
        return ""
