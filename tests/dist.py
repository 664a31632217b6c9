"""Run a function on N gloo ranks (spawned processes on loopback) -- with bounded waits.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank of a
process group and returns the list of results, rank by rank. ``fn`` must be a module-level function
(it is pickled by reference). Workers are kept alive between calls (one pool per world size per
test process), because starting a process costs seconds on a 2-core machine; they are forked from a
server that imported torch once (tests/warm.py) -- or, with ``fork=True``, from the calling process
itself (a script under Triton's interpreter, whose ranks must import triton with its settings: no
second server to start, and the ranks find what it imported).

Failure never hangs:

* every wait has a deadline (``timeout``); gloo collectives time out too (``PG_TIMEOUT``);
* when one rank raises, the pool is torn down at once -- the other ranks may be blocked in a
  collective that will never complete -- and the call fails with that rank's traceback;
* a broken pool is replaced on the next call;
* workers exit by themselves once the test process that spawned them is gone (killed).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import os
import queue
import tempfile
import time
import traceback

from tests import warm

PG_TIMEOUT = datetime.timedelta(seconds=60)
DEFAULT_TIMEOUT = 180.0

_POOLS: dict[tuple[int, bool], "_Pool"] = {}


class RankFailure(AssertionError):
    """A rank raised, timed out or died; carries the remote traceback."""


def _worker(rank, world, store_path, inbox, outbox, test_process):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    while True:
        try:
            job = inbox.get(timeout=5.0)
        except queue.Empty:
            # a test process killed by a signal runs no atexit hook: do not outlive it (leftover
            # pools of killed runs filled a dev machine's memory and timed later runs out). Its pid,
            # not this process's parent: that is the process server, which lives as long as we do
            if not _alive(test_process):
                os._exit(0)
            continue
        if job is None:
            break
        fn, args = job
        try:
            result = fn(rank, world, *args)
            outbox.put((rank, True, result))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Pool:
    def __init__(self, world: int, fork: bool = False):
        # forked from a process that imported torch once (tests/warm.py), or from this one
        ctx = multiprocessing.get_context("fork") if fork else warm.context()
        self.world = world
        self.tmp = tempfile.mkdtemp(prefix="vpce_store_")
        store_path = os.path.join(self.tmp, "store")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, store_path, self.inboxes[r], self.outbox, os.getpid()),
                        daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout: float):
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"{fn.__name__}: ranks {sorted(set(range(self.world)) - set(results))} "
                                  f"did not finish within {timeout:.0f}s")
            try:
                rank, ok, value = self.outbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RankFailure(f"{fn.__name__}: rank(s) {dead} died (exit codes "
                                      f"{[self.procs[r].exitcode for r in dead]})") from None
                continue
            if not ok:
                raise RankFailure(f"{fn.__name__} failed on rank {rank} of {self.world}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world)]

    def close(self, graceful: bool = True):
        if graceful:
            for inbox in self.inboxes:
                inbox.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, fork: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.
    ``fork=True``: ranks forked from this process (before it computes anything: a process forked
    after OpenMP ran may hang in it)."""
    key = (world_size, fork)
    pool = _POOLS.get(key)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(graceful=False)
        pool = _POOLS[key] = _Pool(world_size, fork)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        # Other ranks may be stuck in a collective with the failed one: never reuse this pool.
        _POOLS.pop(key, None)
        pool.close(graceful=False)
        raise


@atexit.register
def _close_all():
    for pool in list(_POOLS.values()):
        pool.close(graceful=True)
    _POOLS.clear()


def errors_of(calls: dict, group=None) -> dict:
    """On a rank of a running group: call each zero-argument callable in ``calls`` and record the
    error it raised (``"TypeError: message"``) or None; a barrier after each call keeps the group
    (``group``, default the whole world) in step, so a case that raised on one rank only shows up
    as a hang-free mismatch."""
    import torch.distributed as dist

    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier(group=group)
    return errors


def unmet(cases: dict, where: str, group=None) -> list[str]:
    """Run :func:`errors_of` on ``{name: (call, words)}`` and return a failure for each case that
    did not raise or whose message lacks one of its ``words``, prefixed by ``where``."""
    errors = errors_of({name: call for name, (call, _) in cases.items()}, group)
    return [f"{where} {name}: {errors[name]!r} lacks {words}" for name, (_, words) in cases.items()
            if errors[name] is None or not all(w in errors[name] for w in words)]


@contextlib.contextmanager
def one_thread():
    """In-process cases on tiny tensors: a thread pool's hand-offs cost far more than the math on
    a busy 2-core machine (the spawned ranks run single-threaded already)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
