"""PNG timeline of chaos runs (matplotlib, imported only when --plot is given): one row per
rank with its training steps, saves and loads, plus the faults and recovery markers."""

from __future__ import annotations

from typing import Any

from resilient.chaos.plan import RunResult

_MARKS = {"save_end": ("s", "tab:green"), "load": ("D", "tab:blue"), "detected": ("x", "red"),
          "fatal": ("X", "black"), "done": ("*", "gold")}


def plot_timelines(results: list[RunResult], path: str) -> None:
    """Writes one panel per run to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results) + 0.6),
                             squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        _panel(ax, res)
    axes[-1, 0].set_xlabel("seconds since launch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax: Any, res: RunResult) -> None:
    tl = res.timeline
    t0 = next((e["t"] for e in tl if e["kind"] == "launch"), tl[0]["t"] if tl else 0.0)
    ranks = sorted({e["rank"] for e in tl if isinstance(e.get("rank"), int)})
    for r in ranks:
        steps = [e for e in tl if e.get("rank") == r and e["kind"] == "step"]
        ax.scatter([e["t"] - t0 for e in steps], [r] * len(steps), s=4, color="tab:gray")
        for kind, (marker, color) in _MARKS.items():
            pts = [e["t"] - t0 for e in tl if e.get("rank") == r and e["kind"] == kind]
            if kind == "save_end":
                bad = [e["t"] - t0 for e in tl if e.get("rank") == r and e["kind"] == kind
                       and not e.get("ok")]
                ax.scatter(bad, [r + 0.15] * len(bad), marker="s", color="tab:red", s=30)
                pts = [e["t"] - t0 for e in tl if e.get("rank") == r and e["kind"] == kind
                       and e.get("ok")]
            ax.scatter(pts, [r + 0.15] * len(pts), marker=marker, color=color, s=30)
    for e in tl:
        if e["kind"] == "fault":
            ax.axvline(e["t"] - t0, color="red", linestyle="--", linewidth=1)
            ax.text(e["t"] - t0, len(ranks) - 0.4, e["fault"], color="red", fontsize=7)
        elif e["kind"] in ("launch", "teardown_done"):
            ax.axvline(e["t"] - t0, color="tab:purple" if e["kind"] == "launch" else "tab:orange",
                       linestyle=":", linewidth=1)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, max(ranks, default=0) + 0.8)
    ax.set_title(f"{res.plan.name}: {res.outcome} (path: {res.recovery_path}; "
                 "gray steps, green saves, red failed saves, blue loads, dashed faults, "
                 "dotted launch/teardown)", fontsize=8)
