"""Fresh Python processes that do not import torch again (test helper).

A Python that imports torch spends seconds of a 2-core machine doing so, and the suite starts dozens
of them: gloo ranks (tests/dist.py), scripts run under Triton's interpreter, the benchmarks' smoke
runs. Here they are forked from one server per test process that imported torch once
(multiprocessing's ``forkserver`` with torch preloaded), DTensor (``torch.distributed.tensor``,
a second more with sympy, which most ranks import: device meshes, DTensor inputs, the trainers) and,
with a CPU build of torch, ``torch._dynamo`` (1.5 s more, which nearly every process pays: the ops'
eager path is a ``torch.compiler.disable`` function, which imports dynamo at its first call) -- and
nothing else.
vparallel_ce reads environment variables at import (``VPARALLEL_CE_KERNELS``): each process imports
it after its own environment is set, as a new interpreter does. Dynamo imports triton, whose
``@triton.jit`` functions (its standard library's too) are interpreted or compiled as
``TRITON_INTERPRET`` says when they are defined: a process whose ``TRITON_*`` settings differ from
the server's (the scripts run under Triton's interpreter) is forked from a second server started
with its settings (:class:`_Launcher`).

* :func:`context`: the multiprocessing context of those processes (tests/dist.py's ranks);
* :func:`run_python`: ``python -c CODE ARGS``, ``python -m MODULE ARGS`` or ``python FILE ARGS`` with
  an environment and a working directory, returning what ``subprocess.run(..., capture_output=True,
  text=True)`` does, and raising ``subprocess.TimeoutExpired`` (after killing the process and its
  children) past the timeout. A command with other ``TRITON_*`` settings than the server's is forked
  from a second server of its settings; where the server imported another module with other
  settings than the command's environment asks for, the command runs in a new interpreter instead;
* :func:`start_python`: the same started, its output written to files (ranks started together);
  :func:`run_like_torchrun`: the ranks of ``torchrun --nproc_per_node N`` without its agent.
"""

from __future__ import annotations

import atexit
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
# and torch._dynamo where torch is a CPU build: ranks forked from the server can use CUDA only if it
# never initialised the CUDA driver, and dynamo's import has been checked for that on CPU builds only
_CPU_ONLY_PRELOAD = ["torch._dynamo"]


def preload() -> list[str]:
    """The modules the servers import before they fork (:data:`PRELOAD`, and dynamo on a CPU build)."""
    import torch

    return PRELOAD + (_CPU_ONLY_PRELOAD if torch.version.cuda is None and torch.version.hip is None else [])
# {module: prefix of the environment variables it reads at import}
_READ_AT_IMPORT = {"triton": "TRITON_", "vparallel_ce": "VPARALLEL_CE_"}
# the forked process's exit code when the server imported one of them with other settings than asked
FRESH_INTERPRETER_NEEDED = 75


def _read_at_import(env, prefix: str) -> dict:
    return {k: v for k, v in env.items() if k.startswith(prefix)}


def _imported_with_other_settings(env) -> bool:
    """Whether the server imported a module of :data:`_READ_AT_IMPORT` with settings other than
    ``env``'s."""
    return any(name in sys.modules and _read_at_import(env, prefix) != _read_at_import(os.environ, prefix)
               for name, prefix in _READ_AT_IMPORT.items())


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload())
    return ctx


def _python(kind: str, what: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    import runpy

    os.setsid()  # its own process group: killed with its children on a timeout
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    if _imported_with_other_settings(env):
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
    returns, or ``subprocess.TimeoutExpired`` once the process and its children are killed. A
    command whose ``TRITON_*`` settings differ from the server's is forked from a server of its own
    settings instead (:class:`_Launcher`)."""
    args = [sys.executable, *([kind] if kind else []), str(what), *argv]
    with tempfile.TemporaryDirectory(prefix="vpce_warm_") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        triton = _read_at_import(env, "TRITON_")
        if triton != _read_at_import(os.environ, "TRITON_"):
            exitcode = _Launcher.of(triton).run((kind, str(what), list(argv), dict(env), str(cwd), out, err), timeout)
        else:
            proc = start_python(kind, what, *argv, env=env, cwd=cwd, out=out, err=err)
            proc.join(timeout)
            exitcode = proc.exitcode
            if exitcode is None:
                kill(proc)
        if exitcode is None:
            raise subprocess.TimeoutExpired(args, timeout, _read(out), _read(err))
        if exitcode == FRESH_INTERPRETER_NEEDED:
            return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(args, exitcode, _read(out), _read(err))


class _Launcher:
    """A second process server, for commands whose ``TRITON_*`` settings are not the test process's
    (Triton's interpreter): a new interpreter started with those settings, which preloads
    :func:`preload` as the server does and forks one process per command, run as
    :func:`start_python` runs it. Requests on its stdin, one JSON line each; it answers the
    process's pid, then its exit code (negative: the signal that ended it). It ends with the test
    process (its stdin closes)."""

    _running: dict[tuple, "_Launcher"] = {}

    def __init__(self, triton: dict):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env.update(triton, PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests import warm; warm._serve()"], env=env,
                                     cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.unread = b""  # answers read from its pipe, not taken yet

    @classmethod
    def _close_all(cls) -> None:
        for launcher in cls._running.values():
            launcher.proc.stdin.close()  # its loop ends
            try:
                launcher.proc.wait(5)
            except subprocess.TimeoutExpired:
                launcher.proc.kill()
                launcher.proc.wait()
        cls._running.clear()

    @classmethod
    def of(cls, triton: dict) -> "_Launcher":
        key = tuple(sorted(triton.items()))
        launcher = cls._running.get(key)
        if launcher is None or launcher.proc.poll() is not None:
            launcher = cls._running[key] = cls(triton)
        return launcher

    def run(self, request: tuple, timeout: float) -> int | None:
        """The command's exit code, or None once it ran past ``timeout`` and was killed with its
        children."""
        import json
        import select

        deadline = time.monotonic() + timeout + 120  # the launcher's own start (a new interpreter) first
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise RuntimeError(f"the process launcher ended (exit code {self.proc.poll()})") from e

        def answer(until: float) -> int | None:
            # both answers may come in one read: the pipe is read unbuffered, into self.unread
            while b"\n" not in self.unread:
                if not select.select([self.proc.stdout], [], [], max(0.0, until - time.monotonic()))[0]:
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"the process launcher ended (exit code {self.proc.wait()})")
                self.unread += chunk
            line, self.unread = self.unread.split(b"\n", 1)
            return int(line)

        pid = answer(deadline)
        if pid is None:
            self.proc.kill()
            raise RuntimeError(f"the process launcher did not start a process within {timeout + 120:.0f}s")
        code = answer(time.monotonic() + timeout)
        if code is None:
            _kill_group(pid)
            answer(time.monotonic() + 60)  # its exit code, read to keep the launcher's answers in step
        return code


atexit.register(_Launcher._close_all)


def _serve() -> None:
    """:class:`_Launcher`'s process."""
    import json

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what imports print goes to stderr; fd 1 answers no more
    for name in preload():
        __import__(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                answers.close()
                _python(*request)
                code = 0
            except SystemExit as e:  # as multiprocessing's processes and the interpreter end
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - reported as an uncaught exception is
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(pid, file=answers, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=answers, flush=True)


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
    _kill_group(proc.pid)
    proc.join(5)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not its own group yet (os.setsid), or ended
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:  # the process ended before it opened its output
        return ""
