"""Distillation over a vocab-sharded TP group, with gradient accumulation: TP=2 on CPU (gloo), checked
against one big batch computed from the full logits.

    python launch/examples/distillation.py                        # starts its 2 processes itself
    torchrun --nproc_per_node 2 launch/examples/distillation.py   # or under torchrun

A small student (hidden size 16) learns from a wider teacher (hidden size 24) over the same vocab.
Each rank holds its ``torch.chunk`` shard of both lm_heads (Megatron's vocab-parallel layout).
``linear_distillation_loss`` takes both models' final hidden states and their lm_head shards, so
neither model's logits are formed. The loss is ``T**2 * KL(teacher || student)`` at temperature
``T = 2``, plus half the student's cross-entropy against the labels.

The step has 3 microbatches holding 9, 0 and 4 valid tokens (the rest is padding, ``-100``).
``count_valid_tokens`` counts them once per step, and each microbatch passes that count as
``num_valid_tokens``. Then the accumulated gradients are those of the token mean over the whole
step, as one big batch would give, although one microbatch has no valid token at all.
"""

import torch
import torch.distributed as dist
from torch import nn

import vparallel_ce

from _spawn import run_ranks  # this folder's rank starter (the script's folder is on sys.path)

V, H_STUDENT, H_TEACHER, S = 257, 16, 24, 12  # vocab, hidden sizes, tokens per microbatch
VALID = [9, 0, 4]  # valid tokens of the step's microbatches
T, HARD = 2.0, 0.5


class Body(nn.Module):
    """A stand-in for a transformer body: token ids -> final hidden states."""

    def __init__(self, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(V, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, ids):
        return torch.tanh(self.mix(self.emb(ids)))


def make_models():
    torch.manual_seed(0)  # the same full models on every rank
    student, teacher = Body(H_STUDENT), Body(H_TEACHER)
    student_head = torch.randn(V, H_STUDENT) / H_STUDENT**0.5
    teacher_head = torch.randn(V, H_TEACHER) / H_TEACHER**0.5 * 3
    return student, teacher, student_head, teacher_head


def make_step():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(V, (len(VALID), S), generator=g)
    labels = torch.randint(V, (len(VALID), S), generator=g)
    for mb, n in enumerate(VALID):
        labels[mb, n:] = -100  # padding
    return ids, labels


def reference(ids, labels):
    """The step as one big batch, from the full logits (float64)."""
    student, teacher, student_head, teacher_head = make_models()
    student.double()
    head = student_head.double().requires_grad_()
    with torch.no_grad():
        t = teacher.double()(ids) @ teacher_head.double().T
    s = student(ids) @ head.T
    p, log_q = torch.log_softmax(t / T, -1), torch.log_softmax(s / T, -1)
    kl = (p.exp() * (p - log_q)).sum(-1)
    ce = torch.nn.functional.cross_entropy(s.reshape(-1, V), labels.reshape(-1), reduction="none").reshape(labels.shape)
    valid = labels != -100
    loss = ((T * T * kl + HARD * ce) * valid).sum() / valid.sum()
    loss.backward()
    return loss.detach(), student, head.grad


def worker() -> None:
    rank, world, tp = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    student, teacher, student_head, teacher_head = make_models()
    head = student_head.chunk(world)[rank].clone().requires_grad_()  # this rank's vocab rows
    teacher_shard = teacher_head.chunk(world)[rank]
    ids, labels = make_step()

    n = vparallel_ce.count_valid_tokens(labels)  # the whole step's valid tokens: 13
    step_loss = torch.zeros(())
    for mb in range(len(VALID)):
        with torch.no_grad():
            h_teacher = teacher(ids[mb])
        loss = vparallel_ce.linear_distillation_loss(
            student(ids[mb]), head, h_teacher, teacher_shard, labels[mb], group=tp,
            kind="forward_kl", temperature=T, hard_weight=HARD, num_valid_tokens=n)
        loss.backward()  # gradients accumulate over the microbatches
        step_loss += loss.detach()

    ref_loss, ref_student, ref_head_grad = reference(ids, labels)
    torch.testing.assert_close(step_loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.grad.double(), ref_head_grad.chunk(world)[rank], rtol=1e-4, atol=1e-6)
    for (name, p), ref_p in zip(student.named_parameters(), ref_student.parameters()):
        torch.testing.assert_close(p.grad.double(), ref_p.grad, rtol=1e-4, atol=1e-6, msg=name)
    if rank == 0:
        print(f"TP={world}, {len(VALID)} microbatches with {VALID} valid tokens: step loss {step_loss.item():.6f}, "
              f"one big batch {ref_loss.item():.6f}; every student gradient matches: OK", flush=True)


if __name__ == "__main__":
    run_ranks(worker)
