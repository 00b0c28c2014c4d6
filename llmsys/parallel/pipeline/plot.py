"""The picture of a timeline: one row per device, one box per op."""

from __future__ import annotations

from llmsys.parallel.pipeline.schedules import Timeline


COLOURS = {"F": "#4c72b0", "B": "#64b5cd", "BW": "#55a868", "W": "#dd8452", "F&B": "#8172b2"}


def plot_timeline(timeline: Timeline, ax=None, title: str | None = None, show_labels: bool = True):
    """Draw a timeline: one row per device, one box per op (F blue, B teal, BW green, W orange, F&B purple)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        per_device = max(sum(s.device == d for s in timeline.slots) for d in range(timeline.devices))
        _, ax = plt.subplots(figsize=(min(14, 3 + 0.3 * per_device), 0.45 * timeline.devices + 1))
    shortest = min(s.end - s.start for s in timeline.slots)
    for s in timeline.slots:
        second_chunk = len(s.ops) == 1 and timeline.chunk_of(s.ops[0]) % 2 == 1  # lighter: a device's other chunk
        ax.broken_barh([(s.start, s.end - s.start)], (s.device - 0.4, 0.8), facecolors=COLOURS[s.kind],
                       edgecolors="white", alpha=0.55 if second_chunk else 1.0)
        if show_labels and s.end - s.start >= shortest:
            label = "&".join(str(op.microbatch) for op in s.ops)
            ax.text((s.start + s.end) / 2, s.device, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(timeline.devices), [f"device {d}" for d in range(timeline.devices)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    kinds = sorted({s.kind for s in timeline.slots}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7)
    ax.set_title(title or f"{timeline.schedule}: p={timeline.devices}, m={timeline.microbatches}, "
                          f"idle {timeline.idle_fraction():.1%}")
    return ax
