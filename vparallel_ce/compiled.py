"""``torch.compile`` of the public ops: each op is two ``torch.library`` custom ops in the graph.

While dynamo traces a public op (``torch.compiler.is_compiling()``), the op calls :func:`apply`
instead of running its body: a Python chunk loop, kernels of its own and a host read of the target
range are nothing dynamo should trace. :func:`apply` puts ONE custom op in the graph,
``vparallel_ce::forward``, whose real run is the eager op: the front door (:mod:`vparallel_ce.call`:
the same checks and messages, the world-1 target check raising :class:`InvalidInputError` from
inside it), then the op's autograd Function's ``forward`` with the kernels eager would pick. Its
autograd formula (``torch.library.register_autograd``) is ``vparallel_ce::backward``, which runs the
Function's ``backward``. So ``fullgraph=True`` holds at world 1 and the compiled op computes what
the eager one does, on any backend (``eager``, ``aot_eager``, ``inductor``).

The custom ops take the public op's tensors as a list (the tensors present, and a list of which
slots are: autograd does not follow a list input that holds None), so one pair of custom ops serves
every public op, whatever its inputs: the cross-entropy's logits and target, the linear ops'
hidden, weight, target and bias, and the distillation ops' teacher tensors besides (a constant of
the call, detached before it enters: :mod:`vparallel_ce.teacher`). Each op registers its
:data:`Start`, which runs its front door and gives its Function's arguments.

Both ops are functional, as AOTAutograd requires. What a Function's forward leaves its backward
(``ctx`` attributes: statistics per chunk, kept logits, gradients made in forward, the
:class:`~vparallel_ce.call.Call`) leaves the forward op as extra tensor outputs -- every tensor of
it that is not an input -- and comes back as the backward op's inputs; the structure around those
tensors (a template with slots, :func:`~vparallel_ce.compiled_state.strip`) is the same for every call with the same options
and input shapes, and is kept by the forward's run for the backward (:data:`~vparallel_ce.compiled_state.TEMPLATES`). Fake
tensors (tracing) run the same forward with the torch reference kernels, which give the Triton
kernels' shapes: every tensor of the state is its own output, so the count never depends on how a
kernel aliases its results. Symbolic sizes (dynamic shapes) are specialised there (:func:`_static`):
the plan is a Python function of the sizes, so a graph holds for the shapes it was traced with.

The options reach the ops as one string constant (:mod:`vparallel_ce.graph_key`), with the
``torch.autocast`` dtype and the kernel settings (:func:`vparallel_ce.kernels.settings`) in force
when dynamo traced the call: a graph keeps the settings it was traced with. On a process group of
several ranks, or with DTensor inputs, the op runs eagerly between two graphs (:func:`run_eagerly`,
``torch.compiler.disable``: a graph break at the op, no warning): its exchange reads the ranks'
facts on the host and its chunk loop runs collectives.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from . import comm
from .autocast import autocast_dtype
from .dtensor import is_dtensor
from .options import Options
from .compiled_state import TEMPLATES, Ctx, Tensors, fill, keep_template, strip, template_key

__all__ = ["apply", "register", "front_door", "Start", "KEPT_READ_ONLY"]

#: True while a compiled op's backward runs: its kept logits are outputs of the forward op, which
#: the graph may read again (a second backward with ``retain_graph``), so the gradient pass writes
#: into a new buffer instead of over them (:meth:`vparallel_ce.chunk_walk.Schedule.gradients`)
KEPT_READ_ONLY = contextvars.ContextVar("vparallel_ce_kept_logits_read_only", default=False)


#: ``start(tensors, *, op, group, options) -> (args, shape)``: the op's front door on its tensor
#: inputs, giving the autograd Function's arguments (the :class:`~vparallel_ce.call.Call` among
#: them) and the shape of its per-token outputs
Start = Callable[..., tuple[tuple, torch.Size]]


@dataclass(frozen=True)
class _Op:
    function: type  # the autograd Function
    start: Start
    grad_of: tuple  # per Function argument: the position of the op input it is, or None
    target: int  # the position of the target among the op inputs
    optional: frozenset  # the positions of the op inputs that may be None
    outputs: int  # the Function's outputs


_OPS: dict[str, _Op] = {}


def register(name: str, function: type, start: Start, *, grad_of: tuple, target: int,
             optional: frozenset = frozenset(), outputs: int = 1) -> None:
    """Make the op ``name`` compilable: ``function`` is its autograd Function, ``start`` its front
    door (:data:`Start`; :func:`front_door` makes one of ``logits_call`` or ``linear_call``).
    Called by each op's module when it is imported."""
    _OPS[name] = _Op(function, start, grad_of, target, frozenset(optional), outputs)


def front_door(front: Callable, args: Callable) -> Start:
    """The :data:`Start` of an op whose front door is ``front(*tensors, op=, group=, options=)``
    (:func:`~vparallel_ce.call.logits_call`, :func:`~vparallel_ce.call.linear_call`) and whose
    Function takes ``args(inputs)`` then the ``Call``."""

    def start(tensors, *, op: str, group, options: Options):
        call, inp = front(*tensors, op=op, group=group, options=options)
        return (*args(inp), call), inp.shape

    return start


def apply(name: str, tensors: tuple, group, options: Options):
    """What a public op runs while dynamo traces it. ``tensors``: the op's tensor inputs in the
    order its :data:`Start` takes them (``(logits, target)``, ``(hidden, weight, target, bias)``,
    ...); constants -- a teacher's tensors -- come detached. Returns the Function's outputs (one
    tensor or a tuple) and the shape of its per-token outputs, as the eager path has them."""
    op = _op(name)
    if not _one_rank(op, tensors, group):
        return _eager(name, tensors, group, options)
    from .graph_key import key_of, refused_count  # (imports dynamo, which is tracing this call)

    # no check here: an exception raised while dynamo traces reaches the user as dynamo's own error
    # (with fullgraph=True), so the options and tensors are checked by the front door in the op's
    # runs -- its fake run, under tracing, lets a refused call through (:func:`_refused`) and its
    # real run raises what eager raises
    count = options.num_valid_tokens
    if refused_count(count):  # written into the key as it is, for the real run to refuse as eager does
        count = None
    elif count is not None and not isinstance(count, torch.Tensor):
        # an int is a constant of the graph (dynamo specialises it) but not of the key, which would
        # otherwise make a new template (TEMPLATES) for every count
        count = torch.tensor(count, dtype=torch.int64, device=tensors[0].device)
    key = key_of(options, autocast_dtype(tensors[0].device))
    grad = torch.is_grad_enabled()
    need = [grad and t is not None and t.requires_grad for t in tensors]
    # the op inputs go in as the tensors present and where they are (autograd does not follow a
    # list input that holds None)
    present = [t is not None for t in tensors]
    outs = torch.ops.vparallel_ce.forward(name, key, need, present, [t for t in tensors if t is not None], count)
    # the per-token shape: the target's, or without one (a distillation) the input's token dims
    target = tensors[op.target]
    shape = target.shape if target is not None else tensors[0].shape[:-1]
    return (outs[0] if op.outputs == 1 else tuple(outs[:op.outputs])), shape


def _one_rank(op: _Op, tensors: tuple, group) -> bool:
    """Whether the call goes into the graph: plain tensors (no DTensor) on one rank. Anything else,
    bad arguments included, runs eagerly (which raises what eager raises)."""
    for i, t in enumerate(tensors):
        if not (isinstance(t, torch.Tensor) or (t is None and i in op.optional)) or is_dtensor(t):
            return False
    return group is None or comm.world_size(comm.resolve_group(group)) == 1


def run_eagerly(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)`` that imports dynamo at its first call instead of here: dynamo
    meets the call as a graph break and runs ``fn`` eagerly, nothing in it traced. Importing
    ``torch._dynamo`` costs a process about 1.5 s, which importing ``vparallel_ce`` should not
    cost every rank of a job that never compiles; torch's own lazy form of the decorator does that
    (torch decorates its own functions with it, and dynamo skips its module), else the public one."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


@run_eagerly
def _eager(name: str, tensors: tuple, group, options: Options):
    """The eager op, between two graphs."""
    op = _op(name)
    args, shape = op.start(list(tensors), op=name, group=group, options=options)
    return op.function.apply(*args), shape


# ---------------------------------------------------------------------------------------------
# The custom ops


def _static(t):
    """A fake tensor of symbolic shape as one of its concrete shape (guarded): the plan, the chunk
    count and so the state's tensors are Python functions of the sizes. A compiled op is specialised
    to its input shapes (a new shape is a recompile), dynamic shapes or not."""
    if t is None or not any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride(), t.storage_offset())):
        return t
    from torch.fx.experimental.symbolic_shapes import guard_int  # (sympy: imported where a graph is traced)

    return torch.empty_strided([guard_int(s) for s in t.shape], [guard_int(s) for s in t.stride()], dtype=t.dtype,
                               device=t.device)


def _placed(present: list, given) -> list:
    """The op inputs from the tensors ``given`` and whether each was (None where not)."""
    it = iter(given)
    return [next(it) if p else None for p in present]


def _forward(name: str, key: str, need: list, inputs: list, count, *, fake: bool) -> list:
    from .graph_key import as_traced, decode

    op = _op(name)
    if fake:
        inputs, count = [_static(t) for t in inputs], _static(count)
    try:
        options = decode(key)[0]
        if count is not None:
            options = replace(options, num_valid_tokens=count)
        with torch.no_grad(), as_traced(key, inputs[0].device):
            args, _ = op.start(list(inputs), op=name, group=None, options=options)
    except (ValueError, TypeError):
        if not fake:
            raise
        return _refused(op, key, inputs)
    with torch.no_grad(), as_traced(key, inputs[0].device):
        ctx = Ctx(tuple(j is not None and need[j] for j in op.grad_of))
        out = op.function.forward(ctx, *args)
    out = list(out) if isinstance(out, tuple) else [out]
    tensors = Tensors(inputs + [count], out)
    if not any(need):  # no backward: the outputs alone
        return tensors.outputs
    template = strip(ctx, tensors, {})
    if not fake:
        keep_template(template_key(name, key, need, inputs + [count]), template)
    return tensors.outputs + tensors.new


def _refused(op: _Op, key: str, inputs: list) -> list:
    """The fake outputs of a call its front door refuses: what the graph needs to be traced on
    (``op.outputs`` tensors, per token for ``reduction="none"`` and the log-prob ops, else scalars),
    no state. The real run's front door raises the error eager raises, before any output is read."""
    from .graph_key import reduction_of

    reduction = reduction_of(key)
    target = inputs[op.target]
    tokens = target if target is not None else inputs[0][..., 0]
    per_token = reduction == "none" or op.function.__name__.endswith("Logprobs")
    dtype = inputs[0].dtype if inputs[0].is_floating_point() else torch.float32
    shape = (tokens.numel(),) if per_token else ()
    return [torch.empty(shape, dtype=dtype, device=inputs[0].device) for _ in range(op.outputs)]


def _op(name: str) -> _Op:
    """The registered op of a compiled op's name (after ``@``, what the teacher records: the
    temperature of a top-k record, :func:`vparallel_ce.teacher.graph_inputs`)."""
    return _OPS[name.split("@", 1)[0]]


@torch.library.custom_op("vparallel_ce::forward", mutates_args=())
def _forward_op(name: str, key: str, need: list[bool], present: list[bool], given: list[Tensor],
                count: Optional[Tensor]) -> list[Tensor]:
    """The op ``name`` with options ``key`` on its inputs (:func:`_placed`): its outputs, then the
    state its backward needs."""
    return _forward(name, key, need, _placed(present, given), count, fake=False)


@_forward_op.register_fake
def _forward_fake(name, key, need, present, given, count):
    return _forward(name, key, need, _placed(present, given), count, fake=True)


@torch.library.custom_op("vparallel_ce::backward", mutates_args=())
def _backward_op(name: str, key: str, need: list[bool], present: list[bool], given: list[Tensor],
                 count: Optional[Tensor], saved: list[Tensor], grads: list[Optional[Tensor]]) -> list[Tensor]:
    """The gradients of the inputs that ``need`` them, from the forward op's outputs ``saved``."""
    op = _op(name)
    inputs = _placed(present, given)
    template = TEMPLATES[template_key(name, key, need, inputs + [count])]
    ctx = fill(template, inputs + [count] + list(saved), {})
    if ctx.materialize:
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, saved)]
    token = KEPT_READ_ONLY.set(True)
    try:
        with torch.no_grad():  # the Function's own backward, not its second-derivative guard
            got = op.function.backward(ctx, *grads)
    finally:
        KEPT_READ_ONLY.reset(token)
    taken = {StorageWeakRef(t.untyped_storage()) for t in [*inputs, count, *saved] if t is not None}
    result = []
    for j, x in enumerate(inputs):
        if not need[j]:
            continue
        g = next((got[i] for i, src in enumerate(op.grad_of) if src == j), None)
        if g is None:
            g = torch.zeros_like(x, memory_format=torch.contiguous_format)
        elif StorageWeakRef(g.untyped_storage()) in taken:
            g = g.clone(memory_format=torch.contiguous_format)
        result.append(g.reshape(x.shape).contiguous())
    return result


@_backward_op.register_fake
def _backward_fake(name, key, need, present, given, count, saved, grads):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device)
            for j, x in enumerate(_placed(present, given)) if need[j]]


def _setup_context(ctx, inputs, output):
    name, key, need, present, given, count = inputs
    ctx.name, ctx.key, ctx.need, ctx.present = name, key, need, present
    ctx.save_for_backward(*given, count, *output)
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    k = sum(ctx.present)
    given, count, saved = list(ctx.saved_tensors[:k]), ctx.saved_tensors[k], list(ctx.saved_tensors[k + 1:])
    n = _op(ctx.name).outputs
    got = iter(torch.ops.vparallel_ce.backward(ctx.name, ctx.key, ctx.need, ctx.present, given, count, saved,
                                               list(grads[:n])))
    # a gradient per given tensor, in order (None where not needed)
    per_input = [next(got) if needed else None for needed in ctx.need]
    return None, None, None, None, [g for g, p in zip(per_input, ctx.present) if p], None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
