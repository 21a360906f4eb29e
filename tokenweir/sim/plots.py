"""CSV tables, printed tables, PNG plots (matplotlib, Agg backend: no display needed), and a
process-parallel map with a progress bar, shared by `tokenweir sweep` and `tokenweir study`."""

from __future__ import annotations

import csv
import math
import multiprocessing
import sys
from typing import Any, Callable, Optional, Sequence


def parallel_map(fn: Callable, jobs: Sequence[Any], processes: int = 0,
                 desc: str = "points", ray: Optional[str] = None) -> list:
    """[fn(job) for job in jobs], in order, over `processes` forked workers (0: one per CPU),
    with a tqdm progress bar on stderr. `fn` must be a module-level function. With `ray`
    (an address, or "local"), each job is a Ray task instead (sim/ray_points.py), and a job
    that fails stands as a FailedPoint in its place."""
    if ray is not None:
        from tokenweir.sim.ray_points import ray_map

        return ray_map(fn, jobs, ray, desc)
    from tqdm import tqdm

    processes = min(processes or multiprocessing.cpu_count(), len(jobs))
    bar = tqdm(total=len(jobs), desc=desc, file=sys.stderr, leave=False)
    try:
        if processes > 1:
            with multiprocessing.get_context("fork").Pool(processes) as pool:
                results = []
                for result in pool.imap(fn, jobs):
                    results.append(result)
                    bar.update()
                return results
        results = []
        for job in jobs:
            results.append(fn(job))
            bar.update()
        return results
    finally:
        bar.close()


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:,.3f}"
        return str(value)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(rows: list[dict], names: list[str], path: str,
               metrics: Sequence[str] = ("request_throughput", "ttft_p99_ms", "tpot_p50_ms",
                                         "preemptions")) -> str:
    """One panel per metric against the first grid field; one line per combination of the
    other fields."""
    plt = pyplot()
    x, others = names[0], names[1:]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[n] for n in others), []).append(row)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4))
    for ax, metric in zip(axes, metrics):
        for key, group in groups.items():
            label = ", ".join(f"{n}={v}" for n, v in zip(others, key)) or None
            ax.plot([str(r[x]) for r in group], [r[metric] for r in group], marker="o",
                    label=label)
        ax.set_xlabel(x)
        ax.set_title(metric)
    if others:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_xy(rows: list[dict], x: str, ys: Sequence[str], path: str, title: str,
            logx: bool = False, annotate: Optional[str] = None) -> str:
    """One panel per y column against x (numeric)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(ys), figsize=(max(6.5, 4.5 * len(ys)), 3.8),
                             squeeze=False)
    for ax, y in zip(axes[0], ys):
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o")
        if logx:
            ax.set_xscale("log")
        if annotate:
            for r in rows:
                ax.annotate(str(r[annotate]), (r[x], r[y]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel(x)
        ax.set_ylabel(y)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_grouped_bars(rows: list[dict], group: str, series: str, ys: Sequence[str], path: str,
                      title: str) -> str:
    """For each y: bars per `group` value, one bar per `series` value inside each group."""
    plt = pyplot()
    groups = list(dict.fromkeys(r[group] for r in rows))
    kinds = list(dict.fromkeys(r[series] for r in rows))
    by_key = {(r[group], r[series]): r for r in rows}
    width = 0.8 / len(kinds)
    fig, axes = plt.subplots(1, len(ys), figsize=(max(6.5, 4.5 * len(ys)), 3.8),
                             squeeze=False)
    for ax, y in zip(axes[0], ys):
        for offset, kind in enumerate(kinds):
            xs = [g + offset * width for g in range(len(groups))]
            ax.bar(xs, [by_key[(g, kind)][y] for g in groups], width, label=f"{series}={kind}")
        ax.set_xticks([g + width * (len(kinds) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels([str(g) for g in groups])
        ax.set_xlabel(group)
        ax.set_title(y)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
