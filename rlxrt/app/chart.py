"""The PNG of ``rlxrt bench``: speedup over plain decoding per configuration and temperature."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def bench_chart(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(results["temperatures"])
    names = list(next(iter(results["temperatures"].values())))
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 4.6), dpi=110)
    width = 0.8 / len(temps)
    colours = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5"]
    for ti, temp in enumerate(temps):
        rows = results["temperatures"][temp]
        shown = [i for i, n in enumerate(names) if n in rows]  # peers that run greedy only have no other rows
        xs = [i + (ti - (len(temps) - 1) / 2) * width for i in shown]
        vals = [rows[names[i]]["speedup"] for i in shown]
        bars = ax.bar(xs, vals, width, label=f"temperature {temp}", color=colours[ti % len(colours)])
        for b, n in zip(bars, [names[i] for i in shown]):
            acc = rows[n].get("acceptance_rate")
            label = f"{rows[n]['speedup']:.2f}x" + (f"\nα={acc:.2f}" if acc else "")
            ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="#444", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speedup over plain decoding at the same temperature (×)")
    cfg = results["config"]
    ax.set_title(f"rlxrt bench: {cfg['prompts']} held-out prompts × {cfg['repeats']} repeats, "
                 f"{cfg['max_new_tokens']} new tokens, {cfg['threads']} thread(s)", fontsize=9)
    ax.legend(fontsize=8)
    ax.set_ylim(0, max(1.2, ax.get_ylim()[1] * 1.15))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
