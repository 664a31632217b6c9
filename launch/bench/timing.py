"""The one timing helper of every benchmark in this package.

* :func:`timed` -- median milliseconds of a call (CUDA events on a GPU, each call synchronised;
  the host clock on CPU), optionally behind queued GPU work (``ahead_ms``);
* :func:`time_and_peak` -- :func:`timed` of one forward+backward, then one more call from a clean
  state for its peak memory over what was allocated before it (CUDA only);
* :func:`timed_in_rounds` -- :func:`timed` of several methods taken in turn, one call each per
  round, and :func:`peak_of` -- one call's peak memory: a method measured after a long run of
  GEMM-heavy ones no longer meets a hotter, slower GPU than the first one did.

Not run by itself: imported by ``launch.bench.loss``, ``.tp``, ``.rl``, ``.distill``, ``.step`` and ``.fused``.
"""

from __future__ import annotations

import statistics
import time

import torch

GiB = 1024**3


def sync(device) -> None:
    """Wait for ``device``'s queued work (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int, warmup: int, *, setup=None, ahead_ms: float = 0.0) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` (CUDA events on a
    GPU, each call synchronised; host clock otherwise). ``setup()``, if given, runs before every
    call, outside the timed region. ``ahead_ms`` (GPU only): each call is queued behind a spin
    kernel of about that many ms, launched before the call's host work as a model's forward is in
    a training step, and timed from the spin's end: host time the queue hides is not counted
    (``0``: from an idle GPU, where every us of host time before the first kernel is)."""
    cycles = spin_cycles(ahead_ms, device) if ahead_ms else 0
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if cycles:
                torch.cuda._sleep(cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


_CYCLES_PER_MS: dict = {}


def spin_cycles(ms: float, device) -> int:
    """``torch.cuda._sleep`` cycles that spin about ``ms`` on ``device`` (measured once)."""
    if device not in _CYCLES_PER_MS:
        probe = 10**6
        torch.cuda._sleep(probe)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[device] = probe / start.elapsed_time(end)
    return int(ms * _CYCLES_PER_MS[device])


def time_and_peak(step, params, *, repeats: int, warmup: int, device, ahead_ms: float = 0.0):
    """Median ms of ``step()`` (one forward+backward) over ``repeats`` after ``warmup`` (CUDA
    events; host clock on CPU; ``ahead_ms`` as in :func:`timed`), then one more call from a clean
    state for the peak memory over what was allocated before it (GiB, CUDA only). Returns
    ``(ms, peak, that call's result)``. ``params``: the tensors whose ``.grad`` is cleared before
    each call."""
    for _ in range(warmup):
        clear_grads(params)
        step()
    sync(device)
    ms = timed(step, device, repeats, warmup=0, setup=lambda: clear_grads(params), ahead_ms=ahead_ms)
    peak, result = peak_of(step, params, device)
    return ms, peak, result


def timed_in_rounds(steps: dict, params, device, repeats: int, warmup: int, *, ahead_ms: float = 0.0) -> dict:
    """Median ms of each of ``steps`` (name -> call), measured in ``repeats`` rounds that call every
    step once, in turn, after ``warmup`` calls of each: the GPU's clock, which falls as it heats
    under sustained GEMMs (by up to 10% on an H100 within a minute), then weighs on every method
    alike instead of on whichever runs last. ``params``: as in :func:`time_and_peak` (their
    ``.grad`` cleared before each call, and once more at the end). A step that raises is dropped;
    its name maps to the exception."""
    setup = lambda: clear_grads(params)  # noqa: E731
    out, live = {}, dict(steps)
    for name, fn in list(live.items()):
        try:
            for _ in range(warmup):
                setup()
                fn()
        except Exception as e:  # noqa: BLE001 -- an OOM or a missing op: recorded, the rest go on
            out[name] = e
            del live[name]
    times = {name: [] for name in live}
    for _ in range(repeats):
        for name, fn in list(live.items()):
            try:
                times[name].append(timed(fn, device, 1, 0, setup=setup, ahead_ms=ahead_ms))
            except Exception as e:  # noqa: BLE001
                out[name] = e
                del live[name]
    for name in live:
        out[name] = statistics.median(times[name])
    clear_grads(params)
    return out


def clear_grads(params) -> None:
    """``.grad = None`` on each of ``params``: a clean state for the next forward+backward."""
    for p in params:
        p.grad = None


def peak_of(step, params, device):
    """``(peak GiB, result)`` of one call of ``step`` from a clean state: the peak memory allocated
    over what was allocated before it (nan off CUDA); ``params``' ``.grad`` cleared first."""
    clear_grads(params)
    peak = float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    result = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GiB
    return peak, result
