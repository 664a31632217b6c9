"""Plots of a ``launch.bench.loss`` JSON-lines file: the time-vs-memory frontier and time vs chunk
count, as ``frontier.png`` and ``chunks.png``.

    python -m launch.bench.plot                        # results/loss_h200.jsonl -> docs/img/
    python -m launch.bench.plot loss.jsonl --out plots

Needs matplotlib (a benchmark tool, not a dependency of the library).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEERS = ("fp32_plain", "compile", "liger", "cce")
RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def sweep(records, shape, schedule):
    """(chunks, ms, GiB) of our explicit chunk counts for one schedule, sorted by chunks."""
    points = []
    for r in records:
        parts = r["method"].split(":")
        if (r["shape"] == shape and len(parts) == 3 and parts[0] == "ours" and parts[1] == schedule
                and parts[2].isdigit() and "ms" in r):
            points.append((int(parts[2]), r["ms"], r["peak_gib"]))
    return sorted(points)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", type=Path, nargs="?", default=RESULTS / "loss_h200.jsonl")
    p.add_argument("--out", type=Path, default=DOCS_IMG, help="output folder (default: the docs' images)")
    args = p.parse_args()
    records = load(args.jsonl)
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    args.out.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.8))
    for ax, shape in zip(axes, shapes):
        for schedule, marker in (("token", "o-"), ("vocab", "s-")):
            pts = sweep(records, shape, schedule)
            ax.plot([g for _, _, g in pts], [ms for _, ms, _ in pts], marker, label=f"ours {schedule}")
            for k, ms, g in pts:
                ax.annotate(f"x{k}", (g, ms), fontsize=7, xytext=(3, 2), textcoords="offset points")
        for r in records:
            if r["shape"] == shape and "ms" in r and r["method"] in PEERS:
                ax.plot(r["peak_gib"], r["ms"], "x", markersize=8, label=r["method"])
            if r["shape"] == shape and "ms" in r and r["method"] == "ours:auto:auto":
                ax.plot(r["peak_gib"], r["ms"], "*", markersize=12, color="black", label="ours chunks='auto'")
        ax.set_xscale("log")
        ax.set_title(shape)
        ax.set_xlabel("peak extra memory (GiB, log)")
        ax.set_ylabel("fwd+bwd ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    device = next((r["device"] for r in records if r.get("device")), "one device")
    fig.suptitle(f"lm_head + cross-entropy on {device}: time vs memory (lower-left is better)")
    fig.tight_layout()
    fig.savefig(args.out / "frontier.png", dpi=110)

    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6))
    for ax, shape in zip(axes, shapes):
        for schedule, marker in (("token", "o-"), ("vocab", "s-")):
            pts = sweep(records, shape, schedule)
            ax.plot([k for k, _, _ in pts], [ms for _, ms, _ in pts], marker, label=f"ours {schedule}")
        gemm = next((r["ms"] for r in records if r["shape"] == shape and r["method"] == "gemm3"), None)
        if gemm:
            ax.axhline(gemm, color="gray", linestyle="--", label="3 cuBLAS GEMMs")
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("chunks / vocab blocks")
        ax.set_ylabel("fwd+bwd ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("time vs chunk count")
    fig.tight_layout()
    fig.savefig(args.out / "chunks.png", dpi=110)
    print(f"wrote {args.out / 'frontier.png'} and {args.out / 'chunks.png'}")


if __name__ == "__main__":
    main()
