"""Throughput per mode from a ``bench/e2e.py`` result, as a log-scale bar chart (PNG).

    python bench/plot.py bench/results/e2e-h200-2026-11-30-r14-headline.json bench/results/e2e-h200-2026-11-30-r14-headline.png
"""
from __future__ import annotations

import json
import sys

LABELS = [("a_plain", "prefill", "(a) plain SGLang", "#888"),
          ("b_launcher_idle", "prefill", "(b) capture server,\nno capture", "#888"),
          ("a_mixed", "mixed-other", "(a) mixed load:\ndecode clients", "#9c9"),
          ("d_mixed", "mixed-other", "(d) mixed load:\ndecode clients", "#4a7"),
          ("d_mixed", "mixed-capture", "(d) mixed: capturing\nrequests", "#27a"),
          ("d_file_capture", "capture", "(d) every request\ncaptures (64 clients)", "#27a"),
          ("d_open_loop", "capture-open", "(d) capture stream\n(open loop)", "#27a"),
          ("c_json", "json", "(c) SGLang JSON\nreturn_hidden_states", "#c44")]


def _rate(r: dict) -> float:
    """Open-loop streams: the rate responses came back at; closed loops: tokens over the window."""
    return r.get("completion_tok_per_s") or r["tok_per_s"]


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(src))
    cfg = res["config"]
    rows = [(label, _rate(res[m][k]) if k == "capture-open" else res[m][k]["tok_per_s"], color)
            for m, k, label, color in LABELS if k in res.get(m, {})]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bars = ax.bar([r[0] for r in rows], [r[1] for r in rows], color=[r[2] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("prompt tokens / s (log)")
    ax.set_title(f"One H200, DeepSeek-V3 4 layers at Kimi width (hidden {cfg['hidden']}), "
                 f"{cfg['concurrency']} clients x {cfg['tokens']}-token prompts", fontsize=9)
    for b, (_, v, _) in zip(bars, rows, strict=False):
        ax.text(b.get_x() + b.get_width() / 2, v * 1.1, f"{v:,.0f}", ha="center", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
