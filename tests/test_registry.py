"""Specification of the integration surfaces: ``build_loss_fn`` entries, the ``nn.Module``
wrappers and the Megatron drop-in, each against the float64 reference on gloo ranks."""

from __future__ import annotations

import pytest
import torch

import vparallel_ce
from tests.dist import run_ranks
from tests.reference import reference_loss, rel_err, shard
from vparallel_ce.megatron import vocab_parallel_cross_entropy

OPTS = {"label_smoothing": 0.1, "z_loss": 1e-3}


def make_case(seed, s=5, b=3, vocab=31, hidden=6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(s, b, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (s, b), generator=g)
    t[0, 0] = -100
    return h, w, t


def registry_rank(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    hidden, weight, target = make_case(0)
    errs = {}
    for name in ("naive", "chunked", "fused", "plain", "linear_cross_entropy"):
        fn = vparallel_ce.build_loss_fn(name, group=group, **OPTS)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = reference_loss(h @ w.T, target, **OPTS)
        ref.backward()
        hm = hidden.clone().requires_grad_()
        wm = shard(weight, world, rank, 0).clone().requires_grad_()
        if isinstance(fn, vparallel_ce.LinearCrossEntropy):
            out = fn(hm, wm, target)
            out.backward()
        else:
            out = fn(hm @ wm.T, target)
            out.backward()
            # a logits loss gives hidden this shard's part of dh: the model's TP "copy" region
            # (Megatron's f, DTensor's Replicate->Partial) sums the parts
            if group is not None:
                dist.all_reduce(hm.grad, group=group)
        errs[name] = max(rel_err(out, ref), rel_err(hm.grad, h.grad), rel_err(wm.grad, shard(w.grad, world, rank, 0), w.grad))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_registry_entry_matches_the_reference(world):
    results = run_ranks(registry_rank, world) if world > 1 else [registry_rank(0, 1)]
    for errs in results:
        assert max(errs.values()) < 1e-10, errs


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: .*chunked.*fused.*naive"):
        vparallel_ce.build_loss_fn("liger")


def test_modules_hold_their_options():
    fn = vparallel_ce.VocabParallelCrossEntropy(label_smoothing=0.2, reduction="sum")
    assert "label_smoothing=0.2" in repr(fn)
    logits, target = torch.randn(4, 9, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
    assert rel_err(fn(logits, target), reference_loss(logits, target, label_smoothing=0.2, reduction="sum")) < 1e-12


# ---------------------------------------------------------------------------------------------
# Options are checked when the loss is built, not at its first call


WRAPPERS = (vparallel_ce.PlainCrossEntropy, vparallel_ce.VocabParallelCrossEntropy, vparallel_ce.LinearCrossEntropy)


@pytest.mark.parametrize("name", ["naive", "chunked", "fused"])
def test_build_loss_fn_rejects_an_unknown_keyword(name):
    with pytest.raises(TypeError, match=r"unexpected keyword 'chunk_size'.*it takes .*label_smoothing"):
        vparallel_ce.build_loss_fn(name, chunk_size=4)


def test_unknown_keyword_error_suggests_the_close_option():
    with pytest.raises(TypeError, match=r"'chunk_size' \(did you mean 'chunks'\?\)"):
        vparallel_ce.build_loss_fn("chunked", chunk_size=4)


@pytest.mark.parametrize("name, options, message", [
    ("chunked", {"chunks": 0}, r"chunks must be an int in \[1, 2\*\*31\] or 'auto', got 0"),
    ("chunked", {"reduction": "avg"}, r"reduction must be one of .*got 'avg'"),
    ("naive", {"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\], got 1.5"),
    ("naive", {"z_loss": -1.0}, r"z_loss must be a finite number >= 0, got -1.0"),
    ("fused", {"schedule": "rows"}, r"schedule must be one of .*got 'rows'"),
    ("fused", {"policy": "small"}, r"policy must be a vparallel_ce.ChunkPolicy or None, got 'small'"),
    ("fused", {"recompute": False, "reduction": "none"}, r"recompute=False .*reduction='none'"),
    ("fused", {"vocab_size": -5}, r"vocab_size must be a positive int or None, got -5"),
    ("fused", {"check": "no"}, r"check must be True or False, got 'no'"),
    ("fused", {"sequence_parallel": "yes"}, r"sequence_parallel must be True or False, got 'yes'"),
    ("chunked", {"softcap": float("inf")}, r"softcap must be a finite positive number or None, got inf"),
    ("chunked", {"ignore_index": 2**63}, r"ignore_index must be an int64, got 9223372036854775808"),
])
def test_build_loss_fn_rejects_a_bad_value(name, options, message):
    with pytest.raises(ValueError, match=message):
        vparallel_ce.build_loss_fn(name, **options)


def test_build_loss_fn_rejects_a_group_that_is_not_one():
    with pytest.raises(TypeError, match="group must be a ProcessGroup, a 1-D DeviceMesh or None, got str"):
        vparallel_ce.build_loss_fn("fused", group="tp")


@pytest.mark.parametrize("cls, options, error", [
    (vparallel_ce.PlainCrossEntropy, {"chunks": 2}, TypeError),  # the reference has no chunks
    (vparallel_ce.PlainCrossEntropy, {"softcap": 0.0}, ValueError),
    (vparallel_ce.VocabParallelCrossEntropy, {"schedule": "vocab"}, TypeError),  # linear only
    (vparallel_ce.VocabParallelCrossEntropy, {"ignore_index": 1.5}, ValueError),
    (vparallel_ce.LinearCrossEntropy, {"bias": None}, TypeError),  # an input of forward, not an option
    (vparallel_ce.LinearCrossEntropy, {"recompute": "yes"}, ValueError),
])
def test_each_module_wrapper_rejects_bad_options_at_construction(cls, options, error):
    (key,) = options
    with pytest.raises(error, match=rf"{cls.__name__}.*{key}"):
        cls(**options)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_each_module_wrapper_accepts_every_option_of_its_op(cls):
    # every option at the op's own default: an option added to an op without a value check
    # would fail here rather than in a user's constructor
    import inspect

    op = {vparallel_ce.VocabParallelCrossEntropy: vparallel_ce.cross_entropy,
          vparallel_ce.LinearCrossEntropy: vparallel_ce.linear_cross_entropy,
          vparallel_ce.PlainCrossEntropy: vparallel_ce.cross_entropy}[cls]
    defaults = {p.name: p.default for p in inspect.signature(op).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    options = {k: defaults[k] for k in cls.OPTIONS}
    assert cls(**options).options == options


def megatron_rank(rank, world):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2, 29, generator=g, dtype=torch.float64)  # [S, B, V]
    target = torch.randint(0, 29, (6, 2), generator=g)
    errs = []
    for ls in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        ref = reference_loss(full, target, reduction="none", label_smoothing=ls)
        up = torch.rand(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        (ref * up).sum().backward()
        mine = shard(logits, world, rank).clone().requires_grad_()
        out = vocab_parallel_cross_entropy(mine, target, ls, group=dist.group.WORLD)
        assert out.shape == (6, 2)
        (out * up).sum().backward()
        errs += [rel_err(out, ref), rel_err(mine.grad, shard(full.grad, world, rank), full.grad)]
    return max(errs)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_megatron_drop_in_matches_the_reference(world):
    # V=29 over 2 or 4 ranks: uneven partitions, with label smoothing over the GLOBAL vocab
    for err in run_ranks(megatron_rank, world):
        assert err < 1e-12


def test_megatron_drop_in_without_megatron_asks_for_the_group():
    with pytest.raises(ValueError, match="pass group="):
        vocab_parallel_cross_entropy(torch.randn(2, 1, 5), torch.zeros(2, 1, dtype=torch.long))


def torchtitan_style_rank(rank, world):
    """A trunk + ColwiseParallel lm_head via parallelize_module; both loss paths of the docs."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hidden, weight, target = make_case(5, vocab=23)

    def build():
        torch.manual_seed(0)
        model = nn.ModuleDict({"trunk": nn.Linear(6, 6, dtype=torch.float64),
                               "output": nn.Linear(6, 23, bias=False, dtype=torch.float64)})
        return model

    ref_model = build()
    ref = reference_loss(ref_model["output"](torch.tanh(ref_model["trunk"](hidden))), target, reduction="sum")
    ref.backward()
    errs = {}
    for path in ("chunked", "fused"):
        model = build()
        parallelize_module(model["output"], mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        h = torch.tanh(model["trunk"](hidden))
        if path == "chunked":
            loss = vparallel_ce.build_loss_fn("chunked", reduction="sum")(model["output"](h), target)
        else:
            loss = vparallel_ce.build_loss_fn("fused", reduction="sum")(h, model["output"].weight, target)
        loss.backward()
        w_grad = model["output"].weight.grad.full_tensor()
        errs[path] = max(rel_err(loss, ref), rel_err(w_grad, ref_model["output"].weight.grad),
                         rel_err(model["trunk"].weight.grad, ref_model["trunk"].weight.grad))
    return errs


def test_torchtitan_style_parallelize_module_with_both_loss_paths():
    # the trunk's gradient checks that hidden got the FULL gradient on every TP rank
    for errs in run_ranks(torchtitan_style_rank, 2):
        assert max(errs.values()) < 1e-12, errs
