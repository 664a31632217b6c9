"""The sampling set's gather mode on each token's own weight rows: the Triton kernels
(:mod:`vparallel_ce.kernels.gathered_rows`) against the torch version
(:mod:`vparallel_ce.gathered_rows`), and the linear set op through them against float64.

Each check runs in a fresh subprocess: on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` must
be set before triton is imported; :func:`tests.test_kernels._run_checks`), with CUDA compiled; fp32 at tiny sizes:
padding (``-1``) entries whose ``d`` is NaN (never read, never added to row 0), ids repeated across
rows, a chunk with no kept ids, an empty shard, ``dW`` over several chunks into a base sum and
``db`` alone; the set's rows on a shard and its values check against their torch steps; then the
op with ``kernels.use("triton")`` against ``kernels.use("torch")`` in both modes, with a
whole-vocabulary (``-1``) row and a bias, the op over logits likewise, and the set op's ATen ops per
call pinned (host steps that cannot creep back). With CUDA: bf16 at a moderate size against
the float64 reference, both modes.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.test_kernels import _ON_DEVICES, HAS_TRITON, _run_checks

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_KERNEL_CHECKS = textwrap.dedent(
    r"""
    import sys
    import torch
    from vparallel_ce import gathered_rows as ref
    from vparallel_ce.kernels import gathered_rows as tk

    dev = sys.argv[1]

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")

    g = torch.Generator().manual_seed(0)
    ran = 0
    # (tokens, kept ids per row, shard rows, hidden size): H not a multiple of the tiles, K past one
    # block of ids, a chunk with no kept ids, an empty shard; a weight row with more pairs than one
    # block of them, weight rows without pairs, H past one block of dh's and of dW's
    for c, k, v, hd in ((5, 3, 7, 40), (4, 19, 30, 300), (3, 0, 7, 8), (3, 2, 0, 8), (20, 2, 3, 24),
                        (6, 40, 150, 24), (3, 3, 12, 2100)):
        h = torch.randn(c, hd, generator=g)
        w = torch.randn(v, hd, generator=g)
        b = torch.randn(v, generator=g)
        cols = torch.randint(0, max(v, 1), (c, k), generator=g) if v else torch.full((c, k), -1)
        if k and v:
            cols[0, -1] = -1                      # padding / an id of another shard
            cols[1] = cols[0].clamp(min=0)        # ids repeated across rows (row 0 among them)
            cols[-1, 0] = 0
        pad = cols < 0
        d = torch.randn(c, k, generator=g).masked_fill(pad, float("nan"))  # a pad's d is never read
        name = f"c={c} K={k} V={v} H={hd}"
        # a second chunk: other hidden rows, the first chunk's ids in another order
        h2, d2 = torch.randn(2, hd, generator=g), torch.randn(2, k, generator=g)
        cols2 = cols[:2].flip(0).contiguous()
        d2 = d2.masked_fill(cols2 < 0, float("nan"))
        h, w, b, cols, pad, d, h2, d2, cols2 = (a.to(dev) for a in (h, w, b, cols, pad, d, h2, d2, cols2))
        for bias in (None, b):  # the logits of both chunks in one launch
            xs = tk.logits([(cols, h), (cols2, h2)], w, bias, torch.float32)
            xs_ref = ref.logits([(cols, h), (cols2, h2)], w, bias, torch.float32)
            for x, x_ref, kept in zip(xs, xs_ref, (~pad, cols2 >= 0)):
                assert x.shape == x_ref.shape, name
                close(x[kept], x_ref[kept], f"{name} logits bias={bias is not None}")
        close(tk.hidden_grad(d, cols, w), ref.hidden_grad(d, cols, w), f"{name} dh")
        # dW over both chunks into a base sum, rounded to fp32; and db alone
        parts = [(d, cols, h), (d2, cols2, h2)]
        base = torch.randn(v, hd, generator=g).to(dev)
        for with_base in (False, True):
            db, db_ref = torch.ones(v, device=dev), torch.ones(v, device=dev)
            got = tk.weight_grad(parts, w, torch.float32, base.clone() if with_base else None, db)
            want = ref.weight_grad(parts, w, torch.float32, base.clone() if with_base else None, db_ref)
            close(got, want, f"{name} dW base={with_base}")
            close(db, db_ref, f"{name} db")
            assert torch.isfinite(got).all() and torch.isfinite(db).all(), name  # no pad added anywhere
        db, db_ref = torch.zeros(v, device=dev), torch.zeros(v, device=dev)
        assert tk.weight_grad(parts, w, None, None, db) is None
        ref.weight_grad(parts, w, None, None, db_ref)
        close(db, db_ref, f"{name} db alone")
        ran += 1
    # chunks of different widths: the pairs padded to the widest (logits and dW alike)
    h, w = torch.randn(7, 24, generator=g).to(dev), torch.randn(30, 24, generator=g).to(dev)
    parts = [(torch.randint(-1, 30, (4, 5), generator=g).to(dev), h[:4]),
             (torch.randint(-1, 30, (3, 2), generator=g).to(dev), h[4:])]  # (consecutive rows of one h: a view)
    for x, x_ref, (cols, _) in zip(tk.logits(parts, w, None, torch.float32), ref.logits(parts, w, None, torch.float32),
                                   parts):
        close(x[cols >= 0], x_ref[cols >= 0], "widths 5 and 2: logits")
    dparts = [(torch.randn(cols.shape, generator=g).to(dev), cols, hc) for cols, hc in parts]
    close(tk.weight_grad(dparts, w, torch.float32), ref.weight_grad(dparts, w, torch.float32), "widths 5 and 2: dW")
    ran += 1

    # the set's rows mapped to a shard for all chunks at once, and its values check: the kernels
    # against the torch steps, K past one block of ids (130), chunks of uneven and no rows, shards
    # at the start, middle and end and an empty one; ignored rows, whole-vocabulary rows, repeats
    from types import SimpleNamespace
    from vparallel_ce import set_check, set_chunk
    from vparallel_ce.kernels import set_rows as sk
    for n, k in ((9, 3), (5, 40), (6, 130), (4, 0)):  # (K = 3 and 40: each id against the others; 130: sorted)
        ids = torch.randint(-1, 40, (n, k), generator=g) if k > 40 else \
            torch.stack([torch.randperm(41, generator=g)[:k] - 1 for _ in range(n)])  # distinct but one repeat
        t = torch.randint(0, 40, (n,), generator=g)
        if k:
            ids[0] = -1                      # the whole vocabulary
            t[1] = ids[1][ids[1] >= 0][0]    # the target in its row
            ids[2, -1] = ids[2, :-1][ids[2, :-1] >= 0][0]  # a repeat
            ids[3, 1] = 45                   # out of range
        t[min(4, n - 1)] = -100              # ignored
        heights = [2, 0, n - 2]              # chunks of uneven and no rows
        for offset, local in ((0, 10), (30, 10), (40, 0)):
            call = SimpleNamespace(layout=SimpleNamespace(offset=offset, local_size=local),
                                   spec=SimpleNamespace(ignore_index=-100))
            got = sk.set_rows(ids.to(dev), t.to(dev), heights, offset, local, -100)
            want = set_chunk._rows_torch(ids.to(dev), t.to(dev), heights, call)
            name = f"set rows n={n} K={k} shard={offset}+{local}"
            assert got[4] == want[4], (name, got[4], want[4])
            w_k = want[0].shape[1]
            for a, b, what in ((got[0][:, :w_k], want[0], "cols"), (got[1][:, :w_k], want[1], "kept"),
                               (got[2], want[2], "tpos"), *zip(got[3], want[3], ("t_owned", "valid", "in_set", "full"))):
                assert torch.equal(a.cpu(), b.cpu().to(a.dtype)), (name, what, a, b)
            assert not got[1][:, w_k:].any(), name
        # 45 out of range; then in range, with the repeat's row ignored
        for vocab, tt in ((40, t), (46, torch.where(torch.arange(n) == 2, -100, t))):
            got = sk.bad_rows(ids.to(dev), tt.to(dev), -100, vocab)
            assert got == set_check._bad_rows(ids.to(dev), tt.to(dev), -100, vocab), (n, k, vocab, got)
            if k and k <= 40:
                assert got[1] == (None if tt[2] == -100 else 2), (n, k, got)
        ran += 1
    assert tk.GATHERED.name == "triton"
    print("GATHERED_ROWS_OK", ran)
    """
)

# The linear set op on each backend (kernels.use) in both modes (GATHER_RATIO), values and the
# gradients of hidden, weight and bias: the Triton kernels' against the torch version's; the op over
# logits likewise; the set op's host steps per call, pinned.
_OP_CHECKS = textwrap.dedent(
    r"""
    import sys
    import torch
    import vparallel_ce
    from vparallel_ce import kernels, sampling_set

    dev = sys.argv[1]
    g = torch.Generator().manual_seed(1)
    n, hd, v, k = 12, 40, 50, 5
    h = torch.randn(n, hd, generator=g).to(dev)
    w = (torch.randn(v, hd, generator=g) * 0.3).to(dev)
    b = torch.randn(v, generator=g).to(dev)
    t = torch.randint(0, v, (n,), generator=g)
    sup = torch.stack([torch.cat([t[i:i+1], (t[i] + 1 + torch.randperm(v - 1, generator=g)[:k - 1]) % v])
                       for i in range(n)])
    sup[2, 3:] = -1     # padding
    sup[5] = -1         # the whole vocabulary
    t[7] = -100         # ignored
    t, sup = t.to(dev), sup.to(dev)
    with kernels.use("triton"):
        assert kernels.ops_for(w).gathered.name == "triton"
    sets_only = sup.clone()
    sets_only[5] = sup[4]  # no whole-vocabulary row: the gather mode's dW alone, no fp32 sum beside it
    out = {}
    cases = [(mode, rows) for mode in ("gather", "gemm") for rows in ("whole-vocab row", "sets only")]
    for mode, rows in cases:
        sampling_set.GATHER_RATIO = 1 if mode == "gather" else 10**9
        s = sup if rows == "whole-vocab row" else sets_only
        tt = t.clone()
        if rows == "sets only":
            tt[5] = t[4]
        for choice in ("triton", "torch"):
            with kernels.use(choice):
                leaves = [a.clone().requires_grad_() for a in (h, w, b)]
                lp, ent = vparallel_ce.linear_token_logprobs(leaves[0], leaves[1], tt, leaves[2], support=s,
                                                             with_entropy=True, temperature=0.9, chunks=2)
                grads = torch.autograd.grad((lp * torch.linspace(-1, 1, n, device=dev)).sum() + ent.sum(), leaves)
                out[mode, rows, choice] = (lp, ent, *grads)
    for mode, rows in cases:
        for what, a, r in zip(("logp", "entropy", "dh", "dW", "db"), out[mode, rows, "triton"],
                              out[mode, rows, "torch"]):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode} {rows} {what}: {m}")
    # both modes in one call: the second chunk's rows keep 2 ids (20 * 2 <= 50: gathered), the first
    # chunk's 5 (the GEMM), with and without a whole-vocabulary row; against the GEMM mode alone
    for rows, base in (("whole-vocab row", sup), ("sets only", sets_only)):
        s = base.clone()
        s[6:, 2:] = -1  # (each row's target is its first id)
        tt = t.clone()
        if rows == "sets only":
            tt[5] = t[4]
        got = {}
        for mode, ratio in (("mixed", 20), ("gemm", 10**9)):
            sampling_set.GATHER_RATIO = ratio
            with kernels.use("triton" if mode == "mixed" else "torch"):
                leaves = [a.clone().requires_grad_() for a in (h, w, b)]
                lp, ent = vparallel_ce.linear_token_logprobs(leaves[0], leaves[1], tt, leaves[2], support=s,
                                                             with_entropy=True, temperature=0.9, chunks=2)
                grads = torch.autograd.grad((lp * torch.linspace(-1, 1, n, device=dev)).sum() + ent.sum(), leaves)
                got[mode] = (lp, ent, *grads)
        for what, a, r in zip(("logp", "entropy", "dh", "dW", "db"), got["mixed"], got["gemm"]):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"mixed modes {rows} {what}: {m}")
    # the op over given logits on each backend (its rows and row steps are the kernels' too), with a
    # set and with a mask (every row over the whole vocabulary), three chunks
    x = torch.randn(n, v, generator=g).to(dev) * 2
    got = {}
    for choice in ("triton", "torch"):
        with kernels.use(choice):
            for name, kw in (("support", dict(support=sup)), ("top_k", dict(top_k=5))):
                xx = x.clone().requires_grad_()
                lp, ent = vparallel_ce.token_logprobs(xx, t, with_entropy=True, temperature=0.7, chunks=3, **kw)
                gx, = torch.autograd.grad((lp.nan_to_num(0) * torch.linspace(-1, 1, n, device=dev)).sum()
                                          + ent.sum(), xx)
                got[choice, name] = (lp, ent, gx)
    for name in ("support", "top_k"):
        for what, a, r in zip(("logp", "entropy", "dx"), got["triton", name], got["torch", name]):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"logits op {name} {what}: {m}")

    # the host's steps per call with the kernels, forward and backward: ATen ops that launch work
    # (views, allocations and Python scalars aside; the interpreter's own copies unseen), pinned for
    # one chunk and for each chunk more, so small steps cannot creep back into the set op
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    free = {"view", "_unsafe_view", "as_strided", "detach", "_reshape_alias", "t", "unsqueeze", "squeeze", "slice",
            "select", "expand", "alias", "reshape", "empty", "empty_like", "empty_strided", "split", "permute",
            "transpose", "unbind", "new_empty", "lift_fresh", "split_with_sizes", "scalar_tensor"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in free:
                self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    if dev == "cpu":
        from triton.runtime import interpreter
        run = interpreter.InterpretedFunction.run

        def unseen(self, *a, **kw):
            with _disable_current_modes():
                return run(self, *a, **kw)

        interpreter.InterpretedFunction.run = unseen

    def ops_of(chunks):
        sampling_set.GATHER_RATIO = 1
        tt = t.clone()
        tt[5] = t[4]
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with kernels.use("triton"), Ops() as ops:
            vparallel_ce.linear_token_logprobs(hh, ww, tt, support=sets_only, chunks=chunks).sum().backward()
        return ops.seen

    ops_of(1)  # (the first call settles what later calls reuse)
    one, three = ops_of(1), ops_of(3)
    # pinned where measured: one chunk 28 ops in the interpreter, 30 on an H100 (the host reads
    # and copies are ops there; three chunks 67); each chunk more costs at most 20 ops
    assert len(one) <= (28 if dev == "cpu" else 30), (len(one), one)
    assert len(three) - len(one) <= 2 * 20, (len(one), len(three), one, three)
    print("set op ATen ops:", len(one), "one chunk,", len(three), "three chunks")
    print("GATHERED_OP_OK")
    """
)


@pytest.mark.slow
@_ON_DEVICES
def test_kernels_match_the_torch_version(device):
    # one fresh Python for both (its start and imports are most of a small check's time); the op's
    # checks run only once the kernels' have passed
    _run_checks(_KERNEL_CHECKS + "\n" + _OP_CHECKS, device, "GATHERED_OP_OK")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("k", [20, 300])  # the rule gathers at 20 of 32000 and takes the GEMM at 300
@pytest.mark.parametrize("mode", ["rule", "gather", "gemm"])
def test_bf16_set_op_on_cuda_matches_float64(k, mode):
    # N=1024, H=512, V=32000 in bf16 with a bias, two chunks, a whole-vocabulary row and padding:
    # logp, dh, dW, db against float64 on the bf16 values, in each mode
    import vparallel_ce
    from vparallel_ce import kernels, sampling_set

    g = torch.Generator().manual_seed(k)
    n, hd, v = 1024, 512, 32000
    h = (torch.randn(n, hd, generator=g) / 2).bfloat16()
    w = (torch.randn(v, hd, generator=g) / hd**0.5 * 4).bfloat16()
    b = torch.randn(v, generator=g).bfloat16()
    t = torch.randint(0, v, (n,), generator=g)
    sup = torch.argsort(torch.rand(n, v, generator=g), -1)[:, :k]
    sup[:, 0] = torch.where((sup == t[:, None]).any(-1), sup[:, 0], t)
    sup[3, k // 2:] = -1  # padding (the row's target its first id)
    t[3] = sup[3, 0]
    sup[4] = -1           # the whole vocabulary
    u = torch.randn(n, generator=g, dtype=torch.float64)
    leaves = [a.double().requires_grad_() for a in (h, w, b)]
    x = leaves[0] @ leaves[1].T + leaves[2]
    keep = torch.zeros(n, v, dtype=torch.bool)
    for i in range(n):
        row = sup[i][sup[i] >= 0]
        keep[i, row] = True
    keep[4] = True
    want = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1).gather(1, t[:, None])[:, 0]
    want_g = torch.autograd.grad((want * u).sum(), leaves)
    ratio = sampling_set.GATHER_RATIO
    try:
        sampling_set.GATHER_RATIO = {"rule": ratio, "gather": 0, "gemm": 10**9}[mode]
        dev = [a.cuda().requires_grad_() for a in (h, w, b)]
        assert kernels.ops_for(dev[1]).gathered.name == "triton"
        lp = vparallel_ce.linear_token_logprobs(dev[0], dev[1], t.cuda(), dev[2], support=sup.cuda(), chunks=2)
        got_g = torch.autograd.grad((lp.double() * u.cuda()).sum(), dev)
    finally:
        sampling_set.GATHER_RATIO = ratio
    rel = lambda a, r: ((a.double().cpu() - r).abs().max() / r.abs().max()).item()  # noqa: E731
    assert rel(lp, want.detach()) < 2e-2, ("logp", rel(lp, want.detach()))
    for what, a, r in zip(("dh", "dW", "db"), got_g, want_g):
        assert rel(a, r) < 2e-2, (what, rel(a, r))
