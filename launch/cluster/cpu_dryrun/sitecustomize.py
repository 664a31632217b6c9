"""Start-up hook of a CPU dry run of torchtitan_gpu.sh (torchtitan_gpu_cpu.sh puts this folder first
on PYTHONPATH, so every Python process of the run imports it: torchrun's and the trainer's).

* tests/torchtitan_cpu.py's ``use_cpu()``: torchtitan takes the CPU (gloo) where it would take CUDA;
  its memory numbers become the process's peak RSS.
* With ``VPCE_WITHOUT_TORCH212_NAMES=1``, torch loses what torch 2.11 lacks and torch211_compat.py
  stands in for: ``torch.distributed.fsdp.DataParallelMeshDims`` is removed, ``fully_shard``
  refuses a ``dp_mesh_dims`` argument and ``create_block_mask`` a ``separate_full_blocks`` one, as
  torch 2.11's do (its ``create_block_mask`` always separates full blocks, as torch's does by
  default). A torch >= 2.12 then takes the path a torch 2.11 takes through torchtitan's import,
  its FSDP wrapping and its flex-attention masks (the rest of torch 2.11 is not imitated).

Does nothing unless ``VPCE_TITAN_CPU=1``. A dry run's tool, never imported by the library or CI.
"""

import os

if os.environ.get("VPCE_TITAN_CPU") == "1":
    from tests import torchtitan_cpu  # the repository root is on PYTHONPATH

    torchtitan_cpu.use_cpu()
    if os.environ.get("VPCE_WITHOUT_TORCH212_NAMES") == "1":
        import torch.distributed.fsdp as fsdp

        if hasattr(fsdp, "DataParallelMeshDims"):
            del fsdp.DataParallelMeshDims
        full_fully_shard = fsdp.fully_shard

        def fully_shard(module, **kwargs):
            if "dp_mesh_dims" in kwargs:
                raise TypeError("fully_shard() got an unexpected keyword argument 'dp_mesh_dims' (as torch 2.11)")
            return full_fully_shard(module, **kwargs)

        fsdp.fully_shard = fully_shard

        import torch.nn.attention.flex_attention as flex

        full_create_block_mask = flex.create_block_mask

        def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False):
            return full_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile)

        flex.create_block_mask = create_block_mask
