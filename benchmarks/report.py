"""Turn `benchmarks/results/*.jsonl` into the tables of `docs/benchmarks.md` and
the chart `docs/benchmarks.png`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
from typing import Any

import psutil

from . import workload

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
WORKLOADS = ["large", "small", "many", "tiny"]
CONTENDERS = ["eqx_ckpt", "equinox", "orbax", "safetensors", "raw"]
COLUMNS = [
    ("save", None, "durable save"),
    ("load", "cold", "full load, cold"),
    ("load", "warm", "full load, warm"),
    ("params", "cold", "params only, cold"),
    ("params", "warm", "params only, warm"),
    ("open", "cold", "lazy open, cold"),
    ("open", "warm", "lazy open, warm"),
]
# (workload, label, eqx_ckpt op, reference op, reference contender, limit)
TARGETS = [
    ("large", "durable save <= 1.1x raw write+fsync", ("save", None), ("save", None), 1.1),
    ("large", "full load, cold <= 1.1x raw", ("load", "cold"), ("load", "cold"), 1.1),
    ("large", "full load, warm <= 1.2x raw", ("load", "warm"), ("load", "warm"), 1.2),
    ("large", "params-only load, cold <= 1.2x raw read of the params", ("params", "cold"), ("params", "cold"), 1.2),
    ("large", "params-only load, warm <= 1.2x raw read of the params", ("params", "warm"), ("params", "warm"), 1.2),
    ("small", "save <= 2x raw", ("save", None), ("save", None), 2.0),
    ("small", "full load, cold <= 2x raw", ("load", "cold"), ("load", "cold"), 2.0),
    ("small", "full load, warm <= 2x raw", ("load", "warm"), ("load", "warm"), 2.0),
]
PACKAGES = ["jax", "jaxlib", "equinox", "optax", "tensorstore", "orbax-checkpoint", "safetensors", "numpy"]


def load_results(directory: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for name in WORKLOADS:
        path = os.path.join(directory, f"{name}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                out[name] = [json.loads(line) for line in f if line.strip()]
    return out


def pick(rows: list[dict[str, Any]], contender: str, op: str, cache: str | None, key: str = "seconds") -> list[float]:
    return [
        r[key] for r in rows if r["contender"] == contender and r["op"] == op and r.get("cache") == cache and key in r
    ]


def fmt_seconds(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{min(values):.2f} / {statistics.median(values):.2f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """One Markdown table: min / median seconds per contender and operation."""
    present = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    columns = [c for c in COLUMNS if any(r["op"] == c[0] and r.get("cache") == c[1] for r in rows)]
    head = ["contender", *[c[2] for c in columns], "peak RSS added by a full load (median)", "files", "bytes on disk"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for contender in present:
        cells = [f"`{contender}`"] + [fmt_seconds(pick(rows, contender, op, cache)) for op, cache, _ in columns]
        rss = pick(rows, contender, "load", "cold", "rss_added") + pick(rows, contender, "load", "warm", "rss_added")
        saves = [r for r in rows if r["contender"] == contender and r["op"] == "save"]
        cells.append(fmt_bytes(statistics.median(rss)) if rss else "–")
        cells.append(str(saves[-1]["files"]) if saves else "–")
        cells.append(fmt_bytes(saves[-1]["bytes"]) if saves else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ratio(rows: list[dict[str, Any]], mine: tuple[str, Any], ref: tuple[str, Any]) -> float | None:
    a, b = pick(rows, "eqx_ckpt", *mine), pick(rows, "raw", *ref)
    return min(a) / min(b) if a and b else None


def targets(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| workload | target | eqx_ckpt / raw (min over min) | met |", "|---|---|---|---|"]
    for name, label, mine, ref, limit in TARGETS:
        r = ratio(results.get(name, []), mine, ref)
        if r is not None:
            lines.append(f"| {name} | {label} | {r:.2f}x | {'yes' if r <= limit else 'no'} |")
    large = results.get("large", [])
    rss = pick(large, "eqx_ckpt", "load", "cold", "rss_added") + pick(large, "eqx_ckpt", "load", "warm", "rss_added")
    if rss and large:
        state = workload.state_bytes(workload.skeleton(workload.Sizes(**large[0]["sizes"])))
        r = statistics.median(rss) / state
        label = "peak RSS added by a full load <= 1.1x the state's bytes"
        lines.append(f"| large | {label} | {r:.2f}x | {'yes' if r <= 1.1 else 'no'} |")
    many = pick(results.get("many", []), "eqx_ckpt", "open", "cold") + pick(
        results.get("many", []), "eqx_ckpt", "open", "warm"
    )
    if many:
        worst = max(many)
        label = "lazy open <= 1 s (`eqx_ckpt.Checkpoint`, worst run)"
        lines.append(f"| many | {label} | {worst:.3f} s | {'yes' if worst <= 1 else 'no'} |")
    return lines


def machine(directory: str) -> list[str]:
    cpu = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores; RAM: {psutil.virtual_memory().total / 2**30:.0f} GiB",
        f"- OS: Linux {platform.release()}; file system of the results directory: {filesystem(directory)}",
        f"- Python {platform.python_version()}; {', '.join(versions)}",
    ]


def filesystem(directory: str) -> str:
    best, kind = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        if os.path.abspath(directory).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, kind = part.mountpoint, part.fstype
    return kind


def chart(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in WORKLOADS if n in results and n != "tiny"] or list(results)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 3.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        rows = results[name]
        present = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
        columns = [c for c in COLUMNS if any(r["op"] == c[0] and r.get("cache") == c[1] for r in rows)]
        width = 0.8 / max(1, len(present))
        for i, contender in enumerate(present):
            values = [min(pick(rows, contender, op, cache) or [float("nan")]) for op, cache, _ in columns]
            ax.bar([j + i * width for j in range(len(columns))], values, width, label=contender)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))], [c[2] for c in columns])
        ax.set_yscale("log")
        ax.set_ylabel("seconds (min, log scale)")
        ax.set_title(f"{name}: {state_description(rows)}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def state_description(rows: list[dict[str, Any]]) -> str:
    sizes = workload.Sizes(**rows[0]["sizes"])
    like = workload.skeleton(sizes)
    total, params = fmt_bytes(workload.state_bytes(like)), fmt_bytes(workload.state_bytes(like["model"]))
    return f"{len(workload.array_leaves(like))} leaves, {total} (params {params})"


def write(directory: str, command: str, docs: str = DOCS, *, with_chart: bool = True) -> None:
    """Rewrite the generated part of `docs/benchmarks.md` and the chart."""
    results = load_results(directory)
    if not results:
        return
    lines = ["<!-- generated by benchmarks/report.py: do not edit between these markers -->", ""]
    lines += [f"Command: `{command}`", "", *machine(directory), ""]
    lines += ["### Targets", "", *targets(results), ""]
    for name, rows in results.items():
        reps = max((r.get("rep", 0) for r in rows), default=0) + 1
        loads = [r["loadavg"] for r in rows if "loadavg" in r]
        load_note = f"; 1-minute load average during the runs {min(loads):.1f} to {max(loads):.1f}" if loads else ""
        lines += [f"### `{name}`: {state_description(rows)}", ""]
        lines += [f"Seconds, min / median of {reps} runs, each in a fresh process{load_note}.", ""]
        lines += [*table(name, rows), ""]
    lines.append("<!-- end of generated part -->")
    os.makedirs(docs, exist_ok=True)
    path = os.path.join(docs, "benchmarks.md")
    text = pathlib.Path(path).read_text() if os.path.exists(path) else ""
    start, end = "<!-- generated by benchmarks/report.py", "<!-- end of generated part -->"
    generated = "\n".join(lines)
    if start in text and end in text:
        text = text[: text.index(start)] + generated + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text else "# Benchmarks\n\n") + generated + "\n"
    with open(path, "w") as f:
        f.write(text)
    if with_chart:
        chart(results, os.path.join(docs, "benchmarks.png"))
