r"""The lm_head GEMMs of the linear ops in the call's dtypes: the logits (``F.linear`` in the matmul
dtype, or the GEMM's fp32 accumulator as it is for ``Call.logits_dtype``), the inputs and a logits'
gradient as matmul operands, and sums of products rounded at most once into a wider buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import invariant
from .call import Call

__all__ = ["logits", "matmul_operand", "matmul_inputs", "mm_into", "mm_as"]


def logits(call: Call, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``h w^T + b`` (operands in the matmul dtype) in :attr:`Call.logits_dtype`: ``F.linear`` when
    that is the matmul dtype (None), else the GEMM's fp32 accumulator as it is -- ``mm``'s fp32
    output variant where the device has it (CUDA), else from operands upcast to fp32 here (CPU:
    exact products of bf16/fp16 values summed in fp32; the cost is an fp32 copy of this block of
    ``w`` and of ``h``'s rows per GEMM, and the slower fp32 GEMM). The bias is added in fp32."""
    if call.batch_invariant:  # a row's logits from its own row alone, whatever N
        fixed = invariant.ops_for(h, call.kernels).row_gemm
        if fixed is not None:  # one fixed-config Triton GEMM
            return fixed.logits(h, w, b, call.logits_dtype)
        return invariant.rows_by_tiles(lambda tile: _logits(call.logits_dtype, tile, w, b), h)  # one GEMM per tile
    return _logits(call.logits_dtype, h, w, b)


def _logits(wide: torch.dtype | None, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if wide is None:
        return F.linear(h, w, b)
    if h.is_cuda and _CUDA_MM_OUT_DTYPE:
        x = _mm_wide(h, w, wide)
    else:
        x = torch.mm(h.to(wide), w.to(wide).t())
    if b is not None:
        x += b
    return x


_CUDA_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


# A long K summed in the tensor cores' fp32 accumulator loses low bits (it truncates rather than
# rounds): against float64 the log-probs of one cuBLAS GEMM were 2.5-2.7e-6 off at H = 4096, and
# 1.1-1.3e-6 with K in two halves whose fp32 products add with round-to-nearest (addmm's beta = 1
# epilogue), for 1.15-1.24x the GEMM's time (H100; 4096 x 4096 x 151936 and 8192 x 4096 x 18992).
# Short sums gain little, so only a K of at least _SPLIT_K is split.
_SPLIT_K = 2048


def _mm_wide(h: torch.Tensor, w: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """``h w^T`` in ``wide`` (fp32) from 16-bit operands on CUDA: ``mm``'s wide-output variant,
    over two halves of K where K is long (the second added by ``addmm`` into the first)."""
    k = h.shape[-1]
    if k < _SPLIT_K:
        return torch.ops.aten.mm.dtype(h, w.t(), wide)
    half = k // 2
    x = torch.ops.aten.mm.dtype(h[:, :half], w[:, :half].t(), wide)
    return torch.ops.aten.addmm.dtype_out(x, h[:, half:], w[:, half:].t(), wide, beta=1, out=x)


def matmul_operand(dx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A logits' gradient as an operand of the gradient GEMMs: in the matmul ``dtype`` (fp32
    logits' fp32 gradient rounded once, as the matmul-dtype logits' gradient is made)."""
    return dx if dx.dtype == dtype else dx.to(dtype)


def matmul_inputs(call: Call, h, w, b):
    """The inputs cast to the matmul dtype (a no-op outside autocast)."""
    md = call.matmul_dtype

    def cast(x):  # a no-op cast still costs a dispatch: this runs twice per call
        return x if x is None or x.dtype == md else x.to(md)

    return cast(h), cast(w), cast(b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out (+)= a @ b`` with ``out`` possibly wider than ``a``/``b`` (fp32 vs bf16): the product
    is rounded at most once, and a running sum stays in ``out``'s precision."""
    if a.shape[-1] == 0:  # no rows in this chunk: nothing to add, and a sum that starts here is 0
        if not accumulate:
            out.zero_()
        return
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif a.is_cuda and _CUDA_ADDMM_OUT_DTYPE:
        torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, beta=1 if accumulate else 0, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


_CUDA_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def mm_as(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as a new ``dtype`` tensor, rounded once (:func:`mm_into`)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    mm_into(out, a, b, accumulate=False)
    return out
