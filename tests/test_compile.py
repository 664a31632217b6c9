"""``torch.compile`` through every public op (vparallel_ce.compiled).

World 1: ``fullgraph=True`` of a function ending in each op (and the registry's modules) gives the
eager loss and gradients, for each plan mode of the linear op (logits kept, gradients in forward,
recomputed, vocab blocks), the distillation ops with a dense or a top-k teacher, and the options
that change the state the backward reads. The backend is
``aot_eager``: dynamo's fullgraph errors arise while it traces, whatever the backend, and
``aot_eager`` also runs what Inductor relies on -- the custom ops' fake implementations,
AOTAutograd's functional forward/backward split -- without a C++ compiler. Bad targets and bad
top-k records still raise from the compiled call, with eager's message.

TP 2 (gloo ranks): the compiled function equals eager and emits no warning and no warning log
record (the op runs between two graphs there).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import vparallel_ce as v
from tests.dist import run_ranks

BACKEND = "aot_eager"
B, S, H, V = 2, 5, 8, 37


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g)
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, 1] = -100
    return logits, hidden, weight, bias, target


# a teacher of another width (constants: the compiled functions read them as they are)
TEACHER_HIDDEN = torch.randn(B, S, H + 3, generator=torch.Generator().manual_seed(11))
TEACHER_WEIGHT = torch.randn(V, H + 3, generator=torch.Generator().manual_seed(12)) * 0.5
TEACHER_LOGITS = TEACHER_HIDDEN @ TEACHER_WEIGHT.T
TOP_LOGPROBS, TOP_IDS = torch.log_softmax(TEACHER_LOGITS, -1).topk(5, -1)
RECORDS = {tail: v.TopKTeacher(TOP_IDS, TOP_LOGPROBS, tail=tail) for tail in ("bucket", "renormalize")}


def _scalar(out):
    """A scalar of every output, with an upstream gradient that is not 1 per token."""
    outs = out if isinstance(out, tuple) else (out,)
    total = 0
    for k, o in enumerate(outs):
        total = total + (o * (torch.arange(o.numel(), dtype=o.dtype).reshape(o.shape) / 7 + 0.5 + k)).sum()
    return total


CASES = {
    "cross_entropy": lambda x, h, w, b, t: v.cross_entropy(x, t),
    "cross_entropy none, smoothing, z-loss, softcap, chunks": lambda x, h, w, b, t: v.cross_entropy(
        x, t, reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=5.0, chunks=3),
    "cross_entropy tensor count": lambda x, h, w, b, t: v.cross_entropy(x, t, num_valid_tokens=torch.tensor(11)),
    "linear_cross_entropy (logits kept)": lambda x, h, w, b, t: v.linear_cross_entropy(h, w, t, chunks=1),
    "linear_cross_entropy bias, none (logits kept)": lambda x, h, w, b, t: v.linear_cross_entropy(
        h, w, t, b, reduction="none", chunks=1),
    "linear_cross_entropy sum, int count (gradients in forward)": lambda x, h, w, b, t: v.linear_cross_entropy(
        h, w, t, b, chunks=2, num_valid_tokens=7, label_smoothing=0.1),
    "linear_cross_entropy recompute": lambda x, h, w, b, t: v.linear_cross_entropy(
        h, w, t, reduction="sum", chunks=2, recompute=True, z_loss=1e-3),
    "linear_cross_entropy vocab blocks": lambda x, h, w, b, t: v.linear_cross_entropy(
        h, w, t, schedule="vocab", chunks=2, policy=v.ChunkPolicy(min_chunk_tokens=4)),
    "token_logprobs": lambda x, h, w, b, t: v.token_logprobs(x, t, temperature=0.7),
    "token_logprobs with entropy": lambda x, h, w, b, t: v.token_logprobs(x, t, with_entropy=True, chunks=2),
    "linear_token_logprobs": lambda x, h, w, b, t: v.linear_token_logprobs(h, w, t, b),
    "linear_token_logprobs with entropy": lambda x, h, w, b, t: v.linear_token_logprobs(
        h, w, t, with_entropy=True, chunks=2, temperature=1.3),
    "linear_token_logprobs bf16, fp32 logits": lambda x, h, w, b, t: v.linear_token_logprobs(
        h.bfloat16(), w.bfloat16(), t, with_entropy=True, logits_dtype=torch.float32),
    "distillation_loss": lambda x, h, w, b, t: v.distillation_loss(
        x, TEACHER_LOGITS, t, kind="jsd", temperature=2.0, hard_weight=0.3, chunks=2),
    "distillation_loss none, no target": lambda x, h, w, b, t: v.distillation_loss(
        x, TEACHER_LOGITS, kind="reverse_kl", reduction="none"),
    "distillation_loss top-k": lambda x, h, w, b, t: v.distillation_loss(x, RECORDS["bucket"], t, hard_weight=0.5),
    "distillation_loss top-k renormalised, none": lambda x, h, w, b, t: v.distillation_loss(
        x, RECORDS["renormalize"], t, kind="jsd", reduction="none", chunks=2),
    "linear_distillation_loss (gradients in forward)": lambda x, h, w, b, t: v.linear_distillation_loss(
        h, w, TEACHER_HIDDEN, TEACHER_WEIGHT, t, student_bias=b, kind="jsd", chunks=2),
    "linear_distillation_loss none, no target, teacher bias (recomputed)": lambda x, h, w, b, t:
        v.linear_distillation_loss(h, w, TEACHER_HIDDEN, TEACHER_WEIGHT, teacher_bias=b.detach() * 0.5,
                                   reduction="none", temperature=1.5),
    "linear_distillation_loss top-k": lambda x, h, w, b, t: v.linear_distillation_loss(
        h, w, RECORDS["bucket"], target=t, student_bias=b, hard_weight=0.5, chunks=2),
    "linear_distillation_loss top-k renormalised, none": lambda x, h, w, b, t: v.linear_distillation_loss(
        h, w, RECORDS["renormalize"], target=t, kind="reverse_kl", reduction="none"),
    "VocabParallelCrossEntropy": lambda x, h, w, b, t: v.build_loss_fn("chunked", label_smoothing=0.1)(x, t),
    "LinearCrossEntropy": lambda x, h, w, b, t: v.build_loss_fn("fused", chunks=2)(h, w, t, b),
    "PlainCrossEntropy": lambda x, h, w, b, t: v.build_loss_fn("naive", z_loss=1e-3)(x, t),
}


def _run(fn, *tensors):
    """``fn``'s outputs and the gradients of every float input (None where none)."""
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in tensors]
    out = fn(*leaves)
    _scalar(out).backward()
    outs = out if isinstance(out, tuple) else (out,)
    return [o.detach() for o in outs], [a.grad for a in leaves if a.is_floating_point()]


def _assert_same(got, want):
    (outs, grads), (ref_outs, ref_grads) = got, want
    for o, r in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _graph_counter():
    """A backend that keeps every graph dynamo hands it (then runs BACKEND), and that list."""
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)

    return count_graphs, graphs


@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_at_world_1_equals_eager(case):
    fn = CASES[case]
    inputs = _inputs()
    torch._dynamo.reset()
    count_graphs, graphs = _graph_counter()
    _assert_same(_run(torch.compile(fn, fullgraph=True, backend=count_graphs), *inputs), _run(fn, *inputs))
    assert len(graphs) == 1
    if case.startswith(("cross", "linear", "token", "distillation")):  # the op is one custom op of the graph
        ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert ops.count(torch.ops.vparallel_ce.forward) == 1, ops


def test_eager_calls_between_compiled_calls_do_not_recompile():
    """The front door remembers options it has checked; a compiled graph must not guard on that
    memory, which every eager call with new options changes. The policy object lives outside the
    compiled function, as a trainer's would."""
    _, hidden, weight, _, target = _inputs()
    policy = v.ChunkPolicy(min_chunk_tokens=4)
    count_graphs, graphs = _graph_counter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, w, t: v.linear_cross_entropy(h, w, t, chunks=2, policy=policy),
                             fullgraph=True, backend=count_graphs)
    first = compiled(hidden, weight, target)
    v.linear_cross_entropy(hidden, weight, target, label_smoothing=0.3, policy=v.ChunkPolicy(min_chunk_tokens=7))
    v.cross_entropy(hidden @ weight.T, target, z_loss=1e-4, chunks=3)
    torch.testing.assert_close(compiled(hidden, weight, target), first, rtol=0, atol=0)
    assert len(graphs) == 1


def test_bad_targets_raise_from_the_compiled_call():
    logits, hidden, weight, _, target = _inputs()
    bad = target.clone()
    bad[1, 2] = V + 3
    ops = {
        "cross_entropy": lambda t: v.cross_entropy(logits, t),
        "linear_cross_entropy": lambda t: v.linear_cross_entropy(hidden, weight, t),
        "token_logprobs": lambda t: v.token_logprobs(logits, t),
        "linear_token_logprobs": lambda t: v.linear_token_logprobs(hidden, weight, t, with_entropy=True),
        "distillation_loss": lambda t: v.distillation_loss(logits, TEACHER_LOGITS, t),
        "linear_distillation_loss top-k": lambda t: v.linear_distillation_loss(hidden, weight, RECORDS["bucket"], target=t),
    }
    for name, op in ops.items():
        torch._dynamo.reset()
        compiled = torch.compile(op, fullgraph=True, backend=BACKEND)
        compiled(target)  # compiled with good targets; the check runs on every call
        with pytest.raises(v.InvalidInputError) as eager:
            op(bad)
        with pytest.raises(v.InvalidInputError) as got:
            compiled(bad)
        assert str(got.value) == str(eager.value), name
        assert f"outside [0, {V})" in str(got.value)


def test_second_backward_reads_the_kept_logits_again():
    """retain_graph: the compiled backward must not write over the logits the forward op kept."""
    _, hidden, weight, bias, target = _inputs()

    def twice(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        return h.grad, w.grad

    for kwargs in ({"chunks": 1}, {"chunks": 1, "reduction": "none"}, {"chunks": 2, "reduction": "none"}):
        torch._dynamo.reset()
        fn = lambda h, w: v.linear_cross_entropy(h, w, target, bias, **kwargs)  # noqa: E731
        for got, want in zip(twice(torch.compile(fn, fullgraph=True, backend=BACKEND)), twice(fn)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_second_backward_with_the_triton_kernels():
    """The same with the Triton row passes (under the interpreter), whose gradient pass can write
    over logits it owns: the kept ones of a compiled call it must not."""
    from tests.test_kernels import _run_interpreted

    script = ("import tests.test_compile as t; from vparallel_ce import kernels\n"
              "with kernels.use('triton'):\n"
              "    assert kernels.ops_for(t.torch.zeros(1)).grad_logits_ is not None\n"
              "    t.test_second_backward_reads_the_kept_logits_again()\n"
              "print('SECOND_BACKWARD_OK')")
    proc = _run_interpreted(script)
    assert proc.returncode == 0 and "SECOND_BACKWARD_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_autocast_no_grad_and_a_new_shape():
    _, hidden, weight, _, target = _inputs()
    fn = lambda h, w, t: v.linear_cross_entropy(h, w, t, chunks=1)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # matmuls in bf16, as eager inside autocast
        _assert_same(_run(compiled, hidden, weight, target), _run(fn, hidden, weight, target))
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden, weight, target), fn(hidden, weight, target))
    # another token count: dynamo recompiles (with dynamic shapes: the op's fake run specialises them)
    h2, t2 = hidden[:, :3].contiguous(), target[:, :3].contiguous()
    _assert_same(_run(compiled, h2, weight, t2), _run(fn, h2, weight, t2))


# ---------------------------------------------------------------------------------------------
# TP 2


def _tp_rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()[:300]}")

    handler = Collect(level=logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("", "torch", "torch._dynamo", "torch._inductor")]
    for lg in loggers:
        lg.addHandler(handler)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    group = dist.group.WORLD
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a group of one rank: fullgraph too
    logits, hidden, weight, bias, target = _inputs()
    x, w = torch.chunk(logits, world, -1)[rank].contiguous(), torch.chunk(weight, world, 0)[rank].contiguous()
    b = torch.chunk(bias, world)[rank].contiguous()
    rows = slice(rank * S // world, (rank + 1) * S // world)  # this rank's tokens (sequence parallel)
    cases = {
        "cross_entropy": lambda x, h, w: v.cross_entropy(x, target, group=group, label_smoothing=0.1),
        "cross_entropy DTensor": lambda x, h, w: v.cross_entropy(
            DTensor.from_local(x, mesh, [Shard(-1)], run_check=False, shape=logits.shape,
                               stride=logits.stride()), target),
        "linear_cross_entropy": lambda x, h, w: v.linear_cross_entropy(h, w, target, b, group=group, chunks=2),
        "linear_cross_entropy sequence parallel": lambda x, h, w: v.linear_cross_entropy(
            h[:, rows], w, target[:, rows], group=group, sequence_parallel=True, reduction="sum"),
        "token_logprobs": lambda x, h, w: v.token_logprobs(x, target, group=mesh, with_entropy=True),
        "linear_token_logprobs": lambda x, h, w: v.linear_token_logprobs(h, w, target, group=group),
        "distillation_loss": lambda x, h, w: v.distillation_loss(x, x.detach().flip(0), target, group=group, kind="jsd"),
        "linear_distillation_loss top-k": lambda x, h, w: v.linear_distillation_loss(
            h, w, RECORDS["bucket"], target=target, group=group, chunks=2),
        "VocabParallelCrossEntropy": lambda x, h, w: v.build_loss_fn("chunked", group=group)(x, target),
        "PlainCrossEntropy": lambda x, h, w: v.build_loss_fn("naive", group=group)(x, target),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fn in cases.items():
            torch._dynamo.reset()
            compiled = torch.compile(lambda x, h, w, fn=fn: fn(x * 1.0, h, w), backend=BACKEND)
            got, want = _run(compiled, x, hidden, w), _run(fn, x, hidden, w)
            for a, r in zip(got[0] + got[1], want[0] + want[1]):
                assert (r is None and (a is None or not a.any())) or torch.allclose(a, r, rtol=1e-5, atol=1e-6), name
        torch._dynamo.reset()
        solo_fn = lambda x, t: v.cross_entropy(x, t, group=solo)  # noqa: E731
        _assert_same(_run(torch.compile(solo_fn, fullgraph=True, backend=BACKEND), logits, target),
                     _run(solo_fn, logits, target))
    for lg in loggers:
        lg.removeHandler(handler)
    # torch's notices about its own deprecated APIs (some torch builds' imports emit one for
    # torch.jit) are not the op's warnings
    ours = [w for w in caught
            if not (issubclass(w.category, (DeprecationWarning, FutureWarning)) and "torch.jit" in str(w.message))]
    return [str(w.message)[:300] for w in ours], records


@pytest.mark.slow
def test_tp2_compiled_equals_eager_without_warnings():
    for caught, records in run_ranks(_tp_rank, 2, timeout=240):
        assert caught == [] and records == [], (caught, records)


def test_a_bad_top_k_record_raises_from_the_compiled_call():
    logits, hidden, weight, _, target = _inputs()
    record = RECORDS["bucket"]
    ids = record.ids.clone()
    ids[1, 2, 0] = V  # out of range, on a token that counts
    ops = {
        "distillation_loss": lambda i: v.distillation_loss(logits, v.TopKTeacher(i, record.logprobs), target),
        "linear_distillation_loss": lambda i: v.linear_distillation_loss(
            hidden, weight, v.TopKTeacher(i, record.logprobs), target=target),
    }
    for name, op in ops.items():
        torch._dynamo.reset()
        compiled = torch.compile(op, fullgraph=True, backend=BACKEND)
        compiled(record.ids)
        with pytest.raises(v.InvalidInputError) as eager:
            op(ids)
        with pytest.raises(v.InvalidInputError) as got:
            compiled(ids)
        assert str(got.value) == str(eager.value) and f"outside [0, {V})" in str(got.value), name


def test_a_compiled_distillation_gives_the_teacher_no_gradient():
    """A teacher whose tensors require a gradient (a model not under no_grad) still gets none, as
    in eager; an unknown tail mode raises eager's error from the compiled function."""
    _, hidden, weight, _, target = _inputs()
    th, tw = TEACHER_HIDDEN.clone().requires_grad_(), TEACHER_WEIGHT.clone().requires_grad_()
    record = RECORDS["bucket"]
    lp = record.logprobs.clone().requires_grad_()
    torch._dynamo.reset()
    dense = torch.compile(lambda h: v.linear_distillation_loss(h, weight, th, tw, target), fullgraph=True,
                          backend=BACKEND)
    sparse = torch.compile(lambda h: v.distillation_loss(h @ weight.T, v.TopKTeacher(record.ids, lp), target),
                           fullgraph=True, backend=BACKEND)
    for fn in (dense, sparse):
        fn(hidden.clone().requires_grad_()).backward()
    assert th.grad is None and tw.grad is None and lp.grad is None
    with pytest.raises(ValueError, match="TopKTeacher.tail must be one of"):
        torch.compile(lambda h: v.distillation_loss(h, v.TopKTeacher(record.ids, lp, tail="drop"), target),
                      backend=BACKEND)(hidden @ weight.T)
