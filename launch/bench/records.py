"""What the loss benchmarks share about their records (one dict per shape x method): an error as
one line of text, a table cell, the JSON lines written as they come, and the markdown table of
time, peak memory and errors against float64.

Not run by itself: imported by ``launch.bench.distill`` and ``.mtp``.
"""

from __future__ import annotations

import json
import math


def error_text(e: Exception) -> str:
    """An exception as a record's ``error``: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


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
