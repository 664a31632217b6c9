"""Kernel launches per chunk of ``linear_token_logprobs`` on the Triton path: a chunk (a token chunk,
or a vocab block of the vocab schedule) costs its GEMMs and row kernels, not a tail of small torch
ops, so a call of many chunks stays GPU-bound.

Counted on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is imported:
a fresh subprocess, as in ``test_kernels.py``) with ``kernels.use("triton")``, the backend a CUDA
call takes: every aten op that would launch a kernel (views and allocations excluded; what the
interpreter itself runs for a launch excluded) plus one per Triton launch, over one forward and
backward at two chunk counts. The difference over the chunks added is the cost of one chunk.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest

from tests.warm import run_python

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_COUNT = textwrap.dedent(
    r"""
    import collections, json, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode
    import vparallel_ce
    from vparallel_ce import ChunkPolicy, kernels

    NO_LAUNCH = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias",
                 "lift_fresh", "set_", "resize_", "_local_scalar_dense"}

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.inside_kernel = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (self.inside_kernel or func.is_view or name in NO_LAUNCH):
                self.count += 1
            return func(*args, **(kwargs or {}))

    counter = None
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):  # one launch; the interpreter's own copies are not the op's
        counter.count += 1
        counter.inside_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.inside_kernel -= 1

    interpreter.InterpretedFunction.run = counted_run

    def launches(entropy, chunks, policy):
        global counter
        g = torch.Generator().manual_seed(0)
        h = torch.randn(8, 64, generator=g).requires_grad_()
        w = (torch.randn(512, 64, generator=g) / 8).requires_grad_()
        t = torch.randint(0, 512, (8,), generator=g)
        t[::3] = -100
        counter = Launches()
        with counter:
            out = vparallel_ce.linear_token_logprobs(h, w, t, with_entropy=entropy, chunks=chunks, policy=policy,
                                                     temperature=0.8)
            logp, ent = out if entropy else (out, None)
            (logp.sum() if ent is None else logp.sum() + 0.1 * ent.sum()).backward()
        return counter.count

    def vocab(blocks):  # the budget of one block's fp32 logits: blocks of 512 / blocks columns
        return ChunkPolicy(budget_bytes=8 * 512 * 4 // blocks, compact=False)

    found = {}
    with kernels.use("triton"):
        for entropy in (True, False):
            found[f"token entropy={entropy}"] = (launches(entropy, 2, None), launches(entropy, 4, None), 2)
        found["vocab entropy=True"] = (launches(True, "auto", vocab(2)), launches(True, "auto", vocab(4)), 2)
    print("COUNTS", json.dumps(found))
    """
)


@pytest.mark.slow
def test_log_prob_chunks_cost_a_few_launches_each():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    env.pop("VPARALLEL_CE_KERNELS", None)
    proc = run_python("-c", "import tests.fast_interpreter\n" + _COUNT, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    import json

    counts = json.loads(proc.stdout.split("COUNTS", 1)[1])
    # per chunk: its logits GEMM and statistics kernel, then the recomputed logits, the gradient
    # kernel and the dh / dW GEMMs; the per-token torch steps (target maps, merging the blocks'
    # statistics, log S and the entropy, the outputs, the gradient coefficients) run once per call
    # (6 of each; one small kernel per chunk more is fine, a tail of torch ops per chunk is not)
    for case, (few, many, added) in counts.items():
        per_chunk = (many - few) / added
        assert per_chunk <= 8, f"{case}: {per_chunk} launches per chunk ({few} -> {many})"
