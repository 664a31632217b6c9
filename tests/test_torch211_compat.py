"""The torch 2.11 stand-in that shards each module of an FSDP group on its own
(``launch/cluster/torch211_compat.py``, used by the one-GPU torchtitan 0.3.0 benchmark on torch 2.11)."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch" / "cluster"))
import torch211_compat  # noqa: E402


def _recording_fully_shard():
    calls = []

    def fully_shard(module, **kwargs):
        calls.append((module, kwargs))
        return module

    return fully_shard, calls


def test_a_group_of_modules_becomes_one_group_per_module_with_the_same_options():
    fully_shard, calls = _recording_fully_shard()
    norm, lm_head = nn.RMSNorm(8), nn.Linear(8, 16, bias=False)
    got = torch211_compat._one_group_per_module(fully_shard)([norm, lm_head], reshard_after_forward=False)
    assert got == [norm, lm_head]
    assert calls == [(norm, {"reshard_after_forward": False}), (lm_head, {"reshard_after_forward": False})]


def test_a_single_module_or_a_list_of_one_is_passed_through_unchanged():
    fully_shard, calls = _recording_fully_shard()
    block = nn.Linear(4, 4)
    split = torch211_compat._one_group_per_module(fully_shard)
    split(block, mesh=None)
    split([block])
    assert calls == [(block, {"mesh": None}), ([block], {})]


def test_modules_sharing_a_parameter_are_refused_naming_it():
    fully_shard, calls = _recording_fully_shard()
    embed, lm_head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    lm_head.weight = embed.weight  # tied embeddings: torchtitan groups them as one FSDP unit
    with pytest.raises(NotImplementedError, match=r"share a parameter.*module 0's weight and module 1's weight"):
        torch211_compat._one_group_per_module(fully_shard)([embed, lm_head])
    assert calls == []


def test_nothing_is_stood_in_on_a_torch_that_has_what_torchtitan_needs():
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        pytest.skip(f"torch {torch.__version__} lacks what the stand-ins stand in for")
    before = fsdp.fully_shard
    assert torch211_compat.apply() == []
    assert fsdp.fully_shard is before
