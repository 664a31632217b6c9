"""Starts the ranks of the examples in this folder that run a process group (gloo, CPU).

Under torchrun (``RANK`` set) this process is one of the ranks already; run directly
(``python launch/examples/X.py``) it starts the ranks itself, as processes meeting at a free
loopback port. Not part of the library: the examples import it as their sibling module.
"""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(worker, *, nprocs: int = 2) -> None:
    """Call ``worker()`` on every rank of a gloo process group (the default group), then destroy
    the group. ``nprocs``: the number of ranks started here when not under torchrun."""
    if "RANK" in os.environ:  # started by torchrun: the group's size and address are in the environment
        _rank(None, None, worker)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.start_processes(_rank, args=(nprocs, worker), nprocs=nprocs, start_method="spawn")


def _rank(rank: int | None, world: int | None, worker) -> None:
    if rank is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    worker()
    dist.destroy_process_group()
