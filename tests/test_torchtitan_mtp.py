"""DeepSeek-V3 multi-token prediction in torchtitan 0.3 with ``VParallelLinearMTPLoss`` (CPU).

In process, on torchtitan's DeepSeek-V3 debug model (its first two layers, two MTP depths, SDPA
attention): torchtitan's model with its ``MTPLoss`` on the logits against
``VParallelDeepSeekV3Model`` (the same weights) with our fused loss on the heads' hidden states --
the loss and the gradient of every parameter at step 1, with packed documents and ignored labels,
and the validation sum. Then torchtitan's trainer (tests/torchtitan_cpu.py) on its
``deepseek_v3_debugmodel_mtp`` config at world 1, once with its ``MTPLoss`` and once with ours
selected by ``--override.imports``: the same loss and grad-norm curves. With
``VPARALLEL_CE_TORCHTITAN_WORLD2=1`` the same at world 2 under FSDP and TP (two to three minutes on
two cores: outside CI's time budget, so opt-in).
"""

from __future__ import annotations

import os

import pytest

from tests.test_torchtitan import MULTI_RANK, assets, assert_same_curves, needs_titan, train  # noqa: F401 (assets: a fixture)

OVERRIDES = "vparallel_ce.integrations.torchtitan.overrides"
FUSED_MTP = ("--override.imports", f"{OVERRIDES}.vparallel_linear_mtp",
             "--override.imports", f"{OVERRIDES}.vparallel_mtp_hidden_states")
V = 2048  # the debug model's vocab


def _debug_config(depths: int):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel", num_mtp_layers=depths).model
    config.layers = config.layers[:2]  # the dense layer and a MoE one
    for layer in (*config.layers, *config.mtp_layers):
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


@needs_titan
def test_fused_mtp_gives_torchtitans_mtp_loss_and_every_parameters_gradient():
    """Two depths (their mean is scaled), a batch of two packed documents per row with ignored
    labels: the loss over ``global_valid_tokens``, every parameter's gradient (trunk, MTP blocks,
    embeddings, lm_head), then the validation sum without a count."""
    import torch
    from torchtitan.models.deepseek_v3.mtp import MTPLoss

    from vparallel_ce.integrations.torchtitan import VParallelDeepSeekV3Model, VParallelLinearMTPLoss
    from vparallel_ce.integrations.torchtitan.deepseek_v3 import hidden_states_model

    config = _debug_config(depths=2)
    torch.manual_seed(0)
    theirs = config.build()
    with torch.no_grad():
        theirs.init_weights(buffer_device=None)
    ours = hidden_states_model(config).build()
    assert type(ours) is VParallelDeepSeekV3Model
    ours.load_state_dict(theirs.state_dict())
    mtp = MTPLoss.Config(mtp_scale=0.3, global_vocab_size=V)
    their_loss, our_loss = mtp.build(), VParallelLinearMTPLoss.Config(loss_fn=mtp, chunks=3).build()
    # what torchtitan's trainer does for a ChunkedLossWrapper loss
    our_loss.set_lm_head(ours.lm_head)
    ours._skip_lm_head = True

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (2, 16), generator=g)
    labels = torch.randint(0, V, (2, 16), generator=g)
    labels[0, :3] = -100
    positions = torch.cat([torch.arange(10), torch.arange(6)]).repeat(2, 1)  # two documents per row
    count = (labels != -100).sum()
    loss, metrics = our_loss(ours(tokens, positions), labels, count, positions=positions)
    loss.backward()
    want, _ = their_loss(theirs(tokens, positions), labels, count, positions=positions)
    want.backward()
    torch.testing.assert_close(loss, want, msg="loss over global_valid_tokens")
    assert metrics == {}
    grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        ref = grads[name].grad
        assert param.grad is not None and ref is not None, name
        # fp32 sums in another order; MoE experts' gradients are ~1e-5
        tol = 1e-3 * ref.abs().max().item() + 1e-7
        assert (param.grad - ref).abs().max().item() <= tol, f"{name}: gradient differs from MTPLoss's"
    with torch.no_grad():
        total, _ = our_loss(ours(tokens, positions), labels, positions=positions)
        want_total, _ = their_loss(theirs(tokens, positions), labels, positions=positions)
    torch.testing.assert_close(total, want_total, msg="validation sum")


@needs_titan
def test_fused_mtp_is_built_from_torchtitans_mtp_config_and_refuses_what_it_cannot_compute():
    import torch
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel, deepseek_v3_debugmodel_mtp
    from torchtitan.models.deepseek_v3.mtp import MTPLoss

    from vparallel_ce.integrations.torchtitan import VParallelDeepSeekV3Model, VParallelLinearMTPLoss, fused_mtp
    from vparallel_ce.integrations.torchtitan import overrides

    config = fused_mtp(deepseek_v3_debugmodel_mtp(), chunks=4, schedule="vocab")
    assert type(config.model_spec.model) is VParallelDeepSeekV3Model.Config
    assert len(config.model_spec.model.mtp_layers) == 1
    loss = config.loss.build()
    assert isinstance(loss, VParallelLinearMTPLoss) and loss.mtp_scale == 0.3
    assert (loss.options["chunks"], loss.options["schedule"], loss.options["vocab_size"]) == (4, "vocab", V)
    mtp = MTPLoss.Config(mtp_scale=0.1, global_vocab_size=V)
    assert overrides.vparallel_linear_mtp(mtp, chunks=2).build().mtp_scale == 0.1
    with pytest.raises(ValueError, match="replaces torchtitan's MTPLoss"):
        overrides.vparallel_linear_mtp(CrossEntropyLoss.Config())
    with pytest.raises(ValueError, match="replaces torchtitan's MTPLoss"):
        fused_mtp(deepseek_v3_debugmodel())  # no MTP: the plain fused loss is the one to use
    for bad in ({"chunks": "0"}, {"schedule": "rows"}, {"budget_mib": -1.0}):
        with pytest.raises(ValueError):
            VParallelLinearMTPLoss.Config(loss_fn=mtp, **bad).build()
    with pytest.raises(ValueError, match="mtp_scale must be finite"):
        VParallelLinearMTPLoss.Config(loss_fn=MTPLoss.Config(mtp_scale=float("nan"))).build()
    with pytest.raises(ValueError, match="loss_fn must be an MTPLoss.Config"):
        VParallelLinearMTPLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
    # one tensor (a model that is not VParallelDeepSeekV3Model) is named in the error
    loss.set_lm_head(torch.nn.Linear(8, V, bias=False))
    with pytest.raises(ValueError, match="D \\+ 1 >= 2 tensors.*one tensor"):
        loss(torch.randn(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(4)[None])


@needs_titan
@pytest.mark.slow
def test_trainer_gives_torchtitans_mtp_curves(assets, tmp_path):  # noqa: F811 (assets: the fixture)
    """torchtitan's trainer at world 1 (its default spmd_types backend) on the MTP debug config:
    its MTPLoss, then ours through the two overrides. (An untrained model's loss is about
    (1 + mtp_scale) ln V = 9.9: one depth.)"""
    runs = {"torchtitan": (), "fused MTP": FUSED_MTP}
    curves = train(assets, tmp_path, 1, (), runs, config="deepseek_v3_mtp_debugmodel")
    assert_same_curves(curves, max_loss=15.0)


FSDP = (*MULTI_RANK, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_reshard_after_forward",
        "always")
TP = (*MULTI_RANK, "--parallelism.tensor_parallel_degree", "2")


@needs_titan
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VPARALLEL_CE_TORCHTITAN_WORLD2") != "1",
                    reason="opt-in (VPARALLEL_CE_TORCHTITAN_WORLD2=1): minutes of world-2 trainer runs")
def test_fsdp_and_tp_at_world_2_give_torchtitans_mtp_curves(assets, tmp_path):  # noqa: F811
    """FSDP dp2 resharding after every forward (the fused loss unshards the lm_head's group), and
    TP 2 with sequence parallelism (a Shard(0) lm_head weight, Replicate hidden states), each
    against its own torchtitan MTPLoss run, in one pair of processes."""
    layouts = {"FSDP dp2": FSDP, "TP 2": TP}
    runs = {f"{layout}: {name}": (*flags, *extra) for layout, flags in layouts.items()
            for name, extra in (("torchtitan", ()), ("fused MTP", FUSED_MTP))}
    curves = train(assets, tmp_path, 2, (), runs, config="deepseek_v3_mtp_debugmodel", steps=3)
    for layout in layouts:
        assert_same_curves({name: c for name, c in curves.items() if name.startswith(layout)},
                           baseline=f"{layout}: torchtitan", max_loss=15.0)
