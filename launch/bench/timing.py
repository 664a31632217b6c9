"""The one timing helper of every benchmark in this package.

* :func:`timed` -- median milliseconds of a call (CUDA events on a GPU, each call synchronised;
  the host clock on CPU), optionally behind queued GPU work (``ahead_ms``);
* :func:`time_and_peak` -- :func:`timed` of one forward+backward, then one more call from a clean
  state for its peak memory over what was allocated before it (CUDA only).

Not run by itself: imported by ``launch.bench.loss``, ``.tp``, ``.rl`` and ``.fused``.
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
    def clean():
        for p in params:
            p.grad = None

    for _ in range(warmup):
        clean()
        step()
    sync(device)
    ms = timed(step, device, repeats, warmup=0, setup=clean, ahead_ms=ahead_ms)
    clean()
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
    return ms, peak, result
