"""Markdown tables of one ``launch.bench.loss`` run (its JSON lines): every method per shape, and our
points against the peers measured in the same run.

    python -m launch.bench.report                  # the results page's run: results/loss_h200.jsonl
    python -m launch.bench.report loss.jsonl > tables.md

Our points per shape: ``auto`` (``chunks="auto"``, the policy's pick), ``fastest`` (our fastest
exact point), and ``lean`` (our fastest point within a memory bound: 1.15x Liger's peak, or 1.1x
cut-cross-entropy's where Liger is slower than CCE, or 0.15 GiB at the odd vocab). Ratios are
time / time and memory / memory of the same run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEERS = ("fp32_plain", "bf16_plain", "compile", "liger", "cce", "gemm3", "kernels")
RESULTS = Path(__file__).resolve().parent / "results"


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def shape_table(records: list[dict], shape: str) -> list[str]:
    rows = [r for r in records if r["shape"] == shape and "ms" in r]
    n, h, v = rows[0]["N"], rows[0]["H"], rows[0]["V"]
    out = [f"### {shape}: N={n}, H={h}, V={v}", "",
           "| method | plan | ms | peak GiB | err loss | err dh | err dW |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r.get('plan', '')} | {r['ms']:.2f} | {r['peak_gib']:.3f} | "
                   f"{_f(r.get('err_loss'), '.1e')} | {_f(r.get('err_dh'), '.1e')} | {_f(r.get('err_dw'), '.1e')} |")
    return out + [""]


def our_points(records: list[dict], shape: str) -> dict:
    rows = {r["method"]: r for r in records if r["shape"] == shape and "ms" in r}
    ours = [r for m, r in rows.items() if m.startswith("ours:") and len(m.split(":")) == 3]
    pts = {"auto": rows.get("ours:auto:auto"), "fastest": min(ours, key=lambda r: r["ms"], default=None)}
    liger, cce = rows.get("liger"), rows.get("cce")
    if shape.startswith("odd"):
        bound, against = 0.15, "0.15 GiB"
    elif liger and cce and cce["ms"] < liger["ms"]:
        bound, against = 1.1 * cce["peak_gib"], "1.1x CCE's memory"
    elif liger:
        bound, against = 1.15 * liger["peak_gib"], "1.15x Liger's memory"
    else:
        bound, against = None, ""
    lean = [r for r in ours if bound is not None and r["peak_gib"] <= bound]
    pts["lean"] = min(lean, key=lambda r: r["ms"], default=None)
    pts["lean_bound"] = against
    return {"rows": rows, **pts}


def summary(records: list[dict]) -> list[str]:
    out = ["| shape | point | method (plan) | ms / GiB | vs compile | vs Liger | vs CCE |",
           "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in records):
        p = our_points(records, shape)
        rows = p["rows"]

        def ratio(r, peer):
            q = rows.get(peer)
            if r is None or q is None:
                return "-"
            return f"{r['ms'] / q['ms']:.2f}x / {r['peak_gib'] / q['peak_gib']:.2f}x"

        for name in ("auto", "fastest", "lean"):
            r = p[name]
            label = name if name != "lean" else f"lean (<= {p['lean_bound']})"
            if r is None:
                out.append(f"| {shape} | {label} | none | | | | |")
                continue
            out.append(f"| {shape} | {label} | {r['method']} ({r.get('plan', '')}) | {r['ms']:.2f} / "
                       f"{r['peak_gib']:.3f} | {ratio(r, 'compile')} | {ratio(r, 'liger')} | {ratio(r, 'cce')} |")
    return out + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", type=Path, nargs="?", default=RESULTS / "loss_h200.jsonl")
    args = p.parse_args()
    records = load(args.jsonl)
    lines = ["## Our points against the peers (time ratio / memory ratio, same run)", ""] + summary(records)
    lines += ["## Every method", ""]
    for shape in dict.fromkeys(r["shape"] for r in records):
        lines += shape_table(records, shape)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
