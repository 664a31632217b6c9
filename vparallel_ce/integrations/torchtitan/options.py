"""The loss configs' fields -> the keyword options of vparallel_ce's ops.

torchtitan's ``Configurable`` configs are flat dataclasses whose fields the CLI and the override
kwargs set (``chunks=4`` or ``chunks="auto"``, ``recompute="auto"``, sizes in MiB). This module turns
them into the ops' options once, when torchtitan builds the loss; whether a value is valid is then
decided by :func:`vparallel_ce.build_loss_fn`, which checks every option at that moment, so a bad
value raises before the first step.
"""

from __future__ import annotations

from vparallel_ce.policy import ChunkPolicy

__all__ = ["chunks", "recompute", "policy", "common_options", "smoothing_options", "fused_options", "reduction"]


def chunks(value: int | str) -> int | str:
    """``"auto"`` or a positive integer (also given as a string, as the CLI gives it)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"loss chunks must be 'auto' or a positive integer, got {value!r}") from None
    return value


def recompute(value: bool | str | None) -> bool | None:
    """``True``/``False``, or ``"auto"``/``None`` (the policy decides)."""
    if value is None or isinstance(value, bool):
        return value
    table = {"auto": None, "true": True, "false": False}
    text = str(value).strip().lower()
    if text not in table:
        raise ValueError(f"loss recompute must be auto, true or false, got {value!r}")
    return table[text]


def policy(*, budget_mib: float, memory_mib: float = 0.0) -> ChunkPolicy:
    """The chunk policy of ``chunks="auto"``: ``budget_mib`` bounds one chunk's fp32 logits,
    ``memory_mib`` the fused loss's whole peak (0: the library default / none)."""
    for name, value in (("budget_mib", budget_mib), ("memory_mib", memory_mib)):
        if value < 0:
            raise ValueError(f"loss {name} must be >= 0, got {value}")
    return ChunkPolicy(budget_bytes=int(budget_mib * 2**20) if budget_mib else None,
                       memory_bytes=int(memory_mib * 2**20) if memory_mib else None)


def common_options(config) -> dict:
    """The options every loss here shares, from its config. The ops run with ``reduction="mean"``
    over torchtitan's ``global_valid_tokens`` (``num_valid_tokens``), or ``"sum"`` without it: the
    same two results torchtitan's own losses give."""
    return {"chunks": chunks(config.chunks), "check": bool(config.check), "vocab_size": config.global_vocab_size}


def smoothing_options(config) -> dict:
    """The cross-entropies' extra terms (the MTP loss has none)."""
    return {"label_smoothing": float(config.label_smoothing), "z_loss": float(config.z_loss)}


def fused_options(config) -> dict:
    """The fused ops' options: schedule, recompute and the policy's two budgets."""
    return {"schedule": str(config.schedule).strip().lower(), "recompute": recompute(config.recompute),
            "policy": policy(budget_mib=config.budget_mib, memory_mib=config.memory_mib)}


def reduction(global_valid_tokens) -> str:
    """The op's reduction for torchtitan's ``global_valid_tokens``: ``"mean"`` over that count, or
    ``"sum"`` where the trainer gives none (its own ``CrossEntropyLoss`` sums then)."""
    return "sum" if global_valid_tokens is None else "mean"
