"""`check --plot FILE.png|svg`: each device's predicted memory over the schedule (matplotlib, imported here only).

One row per device (the replicas of a group share one row: they run the same sequence), one column per graph:
as written and rewritten. In each panel the live bytes are stacked by category (analysis/categories.py), the
caching allocator's reserved bytes are a line above them, and the device's capacity and usable memory
(capacity less what lies outside the allocator) are horizontal lines; a predicted OOM is marked where it
happens, with what was asked and what was free.
"""

from __future__ import annotations

from ..analysis.allocator import simulate
from ..analysis.categories import CATEGORIES, category
from ..analysis.infer import Typed
from ..analysis.memory import MemoryReport, _signature, device_events, drawable
from ..errors import GraphError, Location, Problem
from ..rewrite.pipeline import Plan
from ..units import fmt_bytes

COLORS = {"weights": "#4e79a7", "training state": "#f28e2c", "receive buffers": "#76b7b2",
          "activations": "#59a14f", "workspace": "#edc949"}
GiB = 2**30
_POINTS = 1600


def _groups(typed: Typed) -> list[list[str]]:
    out: dict[tuple, list[str]] = {}
    for name in typed.ctx.spec.devices:
        out.setdefault(_signature(typed, name), []).append(name)
    return list(out.values())


def _series(typed: Typed, mem: MemoryReport, device: str):
    """x (event index), stacked live bytes per category, reserved bytes, and the OOM index (or None)."""
    import numpy as np

    events, _ = device_events(typed, device)
    d = mem.devices[device]
    cats = {c: i for i, c in enumerate(CATEGORIES)}
    cache: dict[str, int] = {}
    stack = np.zeros((len(CATEGORIES), len(events)), dtype=np.float64)
    live = np.zeros(len(CATEGORIES))
    owner: dict[int, int] = {}
    for i, ev in enumerate(events):
        if ev.op == "alloc":
            if ev.label not in cache:
                cache[ev.label] = cats[category(typed, ev.label)]
            c = cache[ev.label]
            owner[ev.tensor] = c
            live[c] += ev.size
        elif ev.op == "free" and ev.tensor in owner:
            live[owner.pop(ev.tensor)] -= ev.size
        stack[:, i] = live
    reserved = np.array([r for _, r in d.timeline], dtype=np.float64)
    n = min(len(reserved), stack.shape[1])
    oom_at = None
    if d.oom is not None and d.torch.startswith("cuda"):
        sim = simulate(events, d.usable_bytes, mem.allocator)
        oom_at = sim.oom.index if sim.oom is not None else None
    elif d.oom is not None:
        total = stack.sum(axis=0)
        over = np.nonzero(total > d.usable_bytes)[0]
        oom_at = int(over[0]) if len(over) else None
    # keep each bin's highest point, so that no peak disappears when a long sequence is thinned
    idx = np.arange(n)
    if n > _POINTS:
        total = stack[:, :n].sum(axis=0)
        edges = np.linspace(0, n, _POINTS + 1).astype(int)
        idx = np.array([a + int(np.argmax(total[a:b])) for a, b in zip(edges[:-1], edges[1:]) if b > a])
        res_thin = np.array([reserved[a:b].max() for a, b in zip(edges[:-1], edges[1:]) if b > a])
    else:
        res_thin = reserved[:n]
    return idx, stack[:, idx], res_thin, oom_at, len(events)


def _panel(ax, typed: Typed, mem: MemoryReport, group: list[str], title: str, series, unit) -> tuple[float, float]:
    """Draw one device's panel; return (the data's height, the capacity), in `unit`."""
    dev = group[0]
    d = mem.devices[dev]
    x, stack, reserved, oom_at, n = series
    GiB, uname = unit
    ax.stackplot(x, stack / GiB, colors=[COLORS[c] for c in CATEGORIES], labels=list(CATEGORIES), alpha=0.9,
                 linewidth=0)
    ax.plot(x, reserved / GiB, color="#222222", linewidth=1.1, label="reserved (caching allocator)")
    ax.axhline(d.capacity_bytes / GiB, color="#b07aa1", linestyle="--", linewidth=1, label="capacity")
    ax.axhline(d.usable_bytes / GiB, color="#e15759", linestyle=":", linewidth=1.2,
               label="usable (capacity - outside allocator)")
    who = f"{group[0]}..{group[-1]} ({len(group)} replicas)" if len(group) > 2 else ", ".join(group)
    verdict = f"OOM at '{d.oom.node}'" if d.oom else f"fits, headroom {fmt_bytes(d.headroom_bytes)}"
    ax.set_title(f"{title}: {who}\nallocated peak {fmt_bytes(d.peak_bytes)}, reserved peak "
                 f"{fmt_bytes(d.reserved_peak_bytes)}: {verdict}", fontsize=9)
    if oom_at is not None:
        o = d.oom
        ax.axvline(oom_at, color="#e15759", linewidth=1.5)
        ax.axvspan(oom_at, max(n - 1, 1), color="#e15759", alpha=0.07, linewidth=0)
        ax.text(0.99, 0.97, "after the OOM (shaded): what the\nschedule would need if it had the memory",
                transform=ax.transAxes, ha="right", va="top", fontsize=7, color="#b8262a")
        y = d.usable_bytes / GiB
        ax.plot([oom_at], [y], marker="X", markersize=11, color="#e15759", zorder=5)
        ax.annotate(f"OOM: {fmt_bytes(o.requested_bytes)} asked,\n{fmt_bytes(o.free_bytes)} free\n"
                    f"at '{o.node}'", xy=(oom_at, y), xytext=(0.2, 0.6), textcoords="axes fraction", fontsize=8,
                    color="#b8262a", arrowprops={"arrowstyle": "->", "color": "#b8262a"},
                    bbox={"boxstyle": "round", "fc": "white", "ec": "#e15759"})
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylabel(uname)
    ax.grid(axis="y", alpha=0.3)
    top = max(float(reserved.max()) if len(reserved) else 0, float(stack.sum(axis=0).max()))
    return top / GiB, d.capacity_bytes / GiB


def plot_output(path: str) -> str:
    """--plot checked before the graph is: a known suffix, matplotlib importable, a directory that can be written."""
    import importlib.util

    from .outputs import output_file

    if not path.lower().endswith((".png", ".svg", ".pdf")):
        raise GraphError(Problem("the file must end in .png, .svg or .pdf", Location(flag=f"--plot {path}"),
                                 hint="e.g. --plot memory.png"))
    if importlib.util.find_spec("matplotlib") is None:
        raise GraphError(Problem("drawing needs matplotlib, which is not installed", Location(flag=f"--plot {path}"),
                                 hint='pip install "dflash-graph[plot]" (or: pip install matplotlib)'))
    return output_file(path, "--plot")


def plot_plan(plan: Plan, path: str) -> str:
    plot_output(path)
    import matplotlib
    for typed in (plan.original, plan.typed):
        drawable(typed, "--plot")
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"    # text stays text in an SVG: searchable, selectable
    import matplotlib.pyplot as plt

    cols = [("as written", plan.original, plan.memory_before)] if plan.memory_before is not None else []
    cols.append(("rewritten" if plan.rewritten else "as written (--no-rewrite)", plan.typed, plan.memory))
    groups = _groups(plan.typed)
    fig, axes = plt.subplots(len(groups), len(cols), figsize=(6.2 * len(cols), 3.3 * len(groups) + 0.9),
                             squeeze=False, sharey="row")
    for r, group in enumerate(groups):
        series = [_series(typed, mem, group[0]) for _, typed, mem in cols]
        data_top = max(float(max(sr[2].max(), sr[1].sum(axis=0).max())) for sr in series)
        unit = (2**30, "GiB") if data_top >= 2**30 else (2**20, "MiB")
        tops = [_panel(axes[r][c], typed, mem, group, title, series[c], unit)
                for c, (title, typed, mem) in enumerate(cols)]
        data, cap = max(t for t, _ in tops), max(c for _, c in tops)
        if cap <= 5 * data:
            axes[r][0].set_ylim(0, max(data, cap) * 1.2)
        else:       # a device far larger than what runs on it: scale to the data, say where the capacity is
            axes[r][0].set_ylim(0, data * 1.3)
            for ax in axes[r]:
                ax.text(0.99, 0.97, f"capacity {cap:,.0f} {unit[1]}: above the scale", transform=ax.transAxes,
                        ha="right", va="top", fontsize=7, color="#7a5195")
    for ax in axes[-1]:
        ax.set_xlabel("allocation events in schedule order (two training steps)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    spec = plan.typed.ctx.spec
    fig.suptitle(f"{spec.file}: predicted memory per device ('{spec.name}')", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return (f"wrote {path}: memory over the schedule for {sum(len(g) for g in groups)} devices in {len(groups)} "
            f"rows, {' and '.join(t for t, _, _ in cols)}")
