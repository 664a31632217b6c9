"""What the loss benchmarks share: their command line (:func:`parse_run`), and their records (one
dict per shape x method) -- an error as one line of text, a table cell, the JSON lines written as
they come, and the markdown table of time, peak memory and errors against float64.

Not run by itself: imported by ``launch.bench.distill`` and ``.mtp``.
"""

from __future__ import annotations

import argparse
import json
import math
import traceback

import torch


def parse_run(doc: str, argv, *, shapes: dict, smoke_shapes: dict, methods, smoke_methods, more=None):
    """``(args, device, shapes, env)`` of a benchmark's command line: ``--smoke`` (tiny shapes on
    CPU), ``--shapes`` (names or ``AxBx...``), ``--methods``, ``--repeats``, ``--warmup``,
    ``--no-ref``, ``--out``, ``--verbose``, and what ``more(parser)`` adds. ``env``: the torch
    version and device every record carries."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI), 2 repeats")
    p.add_argument("--shapes", default=None, help="comma list of shape names or sizes joined by x")
    p.add_argument("--methods", default=None, help="comma list (default: every method for the shapes)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 10; 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 2; 1 with --smoke)")
    p.add_argument("--no-ref", action="store_true", help="skip the float64 reference (no error columns)")
    p.add_argument("--out", default=None, help="append one JSON line per measurement to this file")
    p.add_argument("--verbose", action="store_true")
    if more is not None:
        more(p)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.methods = [m for m in (args.methods or ",".join(smoke_methods if args.smoke else methods)).split(",") if m]
    args.repeats = args.repeats if args.repeats is not None else (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    known = {**shapes, **smoke_shapes}
    names = args.shapes.split(",") if args.shapes else list(smoke_shapes if args.smoke else shapes)
    chosen = {s: known.get(s) or tuple(int(x) for x in s.lower().split("x")) for s in names}
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    return args, device, chosen, env


def error_text(e: Exception) -> str:
    """An exception as a record's ``error``: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def record_error(rec: dict, e: Exception, verbose: bool) -> None:
    """A method's failure (an OOM, a missing op) in its record, so the other methods go on; its
    traceback printed too with ``--verbose``."""
    rec.update(error=error_text(e))
    if verbose:
        traceback.print_exception(e)


def cell(x, spec: str) -> str:
    """``x`` formatted for a table, ``-`` where missing or nan."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


class JsonLines:
    """``emit(record)``: the record with ``env`` added, printed and appended to ``path`` (if any)
    as one JSON line, flushed at once (a run that dies keeps what it measured). A context manager."""

    def __init__(self, path: str | None, env: dict):
        self.env, self.fh = env, open(path, "a") if path else None

    def __call__(self, rec: dict) -> None:
        line = json.dumps({**rec, **self.env})
        print(line, flush=True)
        if self.fh is not None:
            self.fh.write(line + "\n")
            self.fh.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.fh is not None:
            self.fh.close()


def build_methods(names, make, record) -> tuple[dict, dict]:
    """``(records, fns)`` for the method ``names``: ``record(name)`` starts each one's record,
    ``make(name)`` builds its call (None: not available here). A method that cannot be built
    gets an ``error`` in its record; the others go on."""
    records, fns = {}, {}
    for name in names:
        records[name] = record(name)
        try:
            fn = make(name)
            if fn is None:
                records[name].update(error="not available here")
            else:
                fns[name] = fn
        except Exception as e:  # noqa: BLE001 -- recorded, the other methods go on
            records[name].update(error=error_text(e))
    return records, fns


def run_shapes(title: str, shapes: dict, bench, out: str | None, env: dict) -> int:
    """``bench(tag, shape, emit)`` for every shape, its records written as they come
    (:class:`JsonLines` to ``out``), then their table under ``title``. Returns the exit status: 1 if
    one of our methods (``ours...``) failed -- peers may be missing or run out of memory."""
    records = []
    with JsonLines(out, env) as emit:
        for tag, shape in shapes.items():
            records += bench(tag, shape, emit)
    print_loss_table(title, records)
    return 1 if any("error" in r for r in records if r["method"].startswith("ours")) else 0


def print_loss_table(title: str, records: list[dict]) -> None:
    """``| shape | method | ms | peak GiB | err loss | err dh | err dW |`` (with ``ms_behind`` where
    measured), a record with an ``error`` as that error."""
    print(f"\n## {title}")
    print("| shape | method | ms | peak GiB | err loss | err dh | err dW |")
    print("|" + "---|" * 7)
    for r in records:
        if "error" in r:
            print(f"| {r['shape']} | {r['method']} | {r['error']} | | | | |")
            continue
        behind = f" ({cell(r['ms_behind'], '.2f')} behind queued work)" if "ms_behind" in r else ""
        print(f"| {r['shape']} | {r['method']} | {cell(r['ms'], '.2f')}{behind} | {cell(r['peak_gib'], '.3f')} | "
              f"{cell(r.get('err_loss'), '.1e')} | {cell(r.get('err_dh'), '.1e')} | {cell(r.get('err_dw'), '.1e')} |")
