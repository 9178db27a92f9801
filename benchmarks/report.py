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

from . import run, workload

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
WORKLOADS = ["large", "small", "many", "tiny"]
CONTENDERS = ["eqx_ckpt", "equinox", "orbax", "safetensors", "raw"]
# (op, page cache, heading, result key): the columns of the detail tables.
COLUMNS = [
    ("save", None, "durable save", "seconds"),
    ("save_async", None, "`blocking=False`: call blocked", "blocked"),
    ("save_async", None, "`blocking=False`: until `wait()`", "committed"),
    ("save_async", None, "`blocking=False`: until `wait()` + fsync", "seconds"),
    ("load", "cold", "full load, cold", "seconds"),
    ("load", "warm", "full load, warm", "seconds"),
    ("params", "cold", "params only, cold", "seconds"),
    ("params", "warm", "params only, warm", "seconds"),
    ("open", "cold", "lazy open, cold", "seconds"),
    ("open", "warm", "lazy open, warm", "seconds"),
]
# Issue 11's targets apply to these workloads (others in the results are added).
TARGET_WORKLOADS = ["small", "many", "large"]
# Target 1's references: eqx_ckpt against the faster of the two single-file formats.
SINGLE_FILE = ("equinox", "safetensors")
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
        r[key]
        for r in rows
        if r["contender"] == contender and r["op"] == op and r.get("cache") == cache and key in r and "error" not in r
    ]


def failed(rows: list[dict[str, Any]], contender: str, op: str, cache: str | None) -> list[dict[str, Any]]:
    same = [r for r in rows if r["contender"] == contender and r["op"] == op and r.get("cache") == cache]
    return [r for r in same if "error" in r]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt_seconds(values: list[float], failures: int = 0) -> str:
    if not values:
        return "failed" if failures else "–"
    text = f"{min(values):.2f} / {statistics.median(values):.2f}"
    return text + (f" ({failures} failed)" if failures else "")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def present_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str | None, str, str]]:
    return [c for c in COLUMNS if any(r["op"] == c[0] and r.get("cache") == c[1] for r in rows)]


def rss_added(rows: list[dict[str, Any]], contender: str) -> list[float]:
    """The peak RSS a full load added, cold and warm runs together."""
    return pick(rows, contender, "load", "cold", "rss_added") + pick(rows, contender, "load", "warm", "rss_added")


def table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """One Markdown table: min / median seconds per contender and operation."""
    present = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]
    columns = present_columns(rows)
    head = ["contender", *[c[2] for c in columns], "peak RSS added by a full load (median)", "files", "bytes on disk"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for contender in present:
        cells = [f"`{contender}`"]
        for op, cache, _, key in columns:
            cells.append(fmt_seconds(pick(rows, contender, op, cache, key), len(failed(rows, contender, op, cache))))
        rss = rss_added(rows, contender)
        saves = [r for r in rows if r["contender"] == contender and r["op"] == "save" and "files" in r]
        cells.append(fmt_bytes(statistics.median(rss)) if rss else "–")
        cells.append(str(saves[-1]["files"]) if saves else "–")
        cells.append(fmt_bytes(saves[-1]["bytes"]) if saves else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per failed measurement, with the first line of its error."""
    headings = {(op, cache): heading for op, cache, heading, _ in COLUMNS}
    headings[("save_async", None)] = "`blocking=False` save"
    lines = []
    for r in rows:
        if "error" in r:
            what = headings.get((r["op"], r.get("cache")), r["op"])
            error = str(r["error"]).strip().splitlines()[0] if str(r["error"]).strip() else "?"
            lines.append(f"- `{r['contender']}`, {what}, run {r.get('rep', 0) + 1}: {error}")
    return lines


def target_row(
    number: int,
    name: str,
    label: str,
    mine: float | None,
    ref: float | None,
    ref_note: str,
    limit: float | None,
    *,
    unit: str = "s",
    percent: bool = False,
    why_missing: str = "not measured",
) -> str:
    """A row of the targets table: eqx_ckpt's median, the reference's, their
    ratio and whether it is within `limit` (`None`: informational)."""

    def show(value: float | None) -> str:
        if value is None:
            return "–"
        return fmt_bytes(value) if unit == "bytes" else f"{value:.3f} s"

    reference = f"{show(ref)} ({ref_note})"
    if mine is None or ref is None or ref <= 0:
        return f"| {number} | {name} | {label} | {show(mine)} | {reference} | – | {why_missing} |"
    r = mine / ref
    ratio = f"{r:.1%}" if percent else f"{r:.2f}x"
    met = "(informational)" if limit is None else ("yes" if r <= limit else "no")
    return f"| {number} | {name} | {label} | {show(mine)} | {reference} | {ratio} | {met} |"


def missing(rows: list[dict[str, Any]], contender: str, op: str, cache: str | None) -> str:
    if not rows:
        return "not measured (workload not run)"
    return "not measured (failed)" if failed(rows, contender, op, cache) else "not measured"


def targets(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Issue 11's targets, each on the medians of one run."""
    head = "| # | workload | target | eqx_ckpt (median) | reference (median) | ratio | met |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    names = TARGET_WORKLOADS + [n for n in results if n not in TARGET_WORKLOADS]
    # 1. Durable save and full loads at most as slow as the faster single-file format.
    first = (("save", None, "durable save"), ("load", "cold", "full load, cold"), ("load", "warm", "full load, warm"))
    for name in names:
        rows = results.get(name, [])
        for op, cache, what in first:
            mine = median(pick(rows, "eqx_ckpt", op, cache))
            refs = {c: m for c in SINGLE_FILE if (m := median(pick(rows, c, op, cache))) is not None}
            best = min(refs, key=lambda c: refs[c]) if refs else None
            note = f"`{best}`" if best else " / ".join(f"`{c}`" for c in SINGLE_FILE)
            label = f"{what} <= 1.0x the faster of {' and '.join(SINGLE_FILE)}"
            why = missing(rows, "eqx_ckpt", op, cache) if mine is None else missing(rows, SINGLE_FILE[0], op, cache)
            lines.append(target_row(1, name, label, mine, refs.get(best) if best else None, note, 1.0, why_missing=why))
    # 2. The large workload against the physical reference, and the memory of a load.
    rows = results.get("large", [])
    for op, cache, label, limit in (
        ("load", "cold", "full load, cold <= 1.2x raw", 1.2),
        ("load", "warm", "full load, warm <= 1.5x raw", 1.5),
        ("params", "cold", "params-only load, cold <= 1.2x raw read of the params", 1.2),
    ):
        mine, ref = median(pick(rows, "eqx_ckpt", op, cache)), median(pick(rows, "raw", op, cache))
        why = missing(rows, "eqx_ckpt" if mine is None else "raw", op, cache)
        lines.append(target_row(2, "large", label, mine, ref, "`raw`", limit, why_missing=why))
    state = workload.state_bytes(workload.skeleton(workload.Sizes(**rows[0]["sizes"]))) if rows else None
    lines.append(
        target_row(
            2,
            "large",
            "peak RSS added by a full load <= 1.2x the state's bytes",
            median(rss_added(rows, "eqx_ckpt")),
            state,
            "the state's bytes",
            1.2,
            unit="bytes",
            why_missing=missing(rows, "eqx_ckpt", "load", "cold"),
        )
    )
    # 3. An asynchronous save blocks the caller for a tenth of a synchronous one.
    for name in names:
        rows = results.get(name, [])
        blocked = median(pick(rows, "eqx_ckpt", "save_async", None, "blocked"))
        sync = median(pick(rows, "eqx_ckpt", "save", None))
        label = "`blocking=False` blocks the caller <= 10% of a synchronous save"
        why = missing(rows, "eqx_ckpt", "save_async" if blocked is None else "save", None)
        note = "`eqx_ckpt`, synchronous save"
        lines.append(target_row(3, name, label, blocked, sync, note, 0.1, percent=True, why_missing=why))
    # 4. Partial loads: no regression (no bound of their own); params-only loads
    # against raw's read of the same bytes, so runs can be compared.
    for name in names:
        rows = results.get(name, [])
        measured = {r["op"] for r in rows}
        for cache in ("cold", "warm"):
            if f"params_{cache}" not in run.OPS.get(name, []) and "params" not in measured:
                continue
            mine, ref = median(pick(rows, "eqx_ckpt", "params", cache)), median(pick(rows, "raw", "params", cache))
            label = f"params-only load, {cache}: no regression"
            why = missing(rows, "eqx_ckpt" if mine is None else "raw", "params", cache)
            lines.append(target_row(4, name, label, mine, ref, "`raw`", None, why_missing=why))
        if "open_cold" in run.OPS.get(name, []) or "open" in measured:
            opens = pick(rows, "eqx_ckpt", "open", "cold") + pick(rows, "eqx_ckpt", "open", "warm")
            label = "lazy open (`eqx_ckpt.Checkpoint`, worst run) <= 1 s, as before: no regression"
            why = missing(rows, "eqx_ckpt", "open", "cold")
            lines.append(target_row(4, name, label, max(opens) if opens else None, 1.0, "bound", 1.0, why_missing=why))
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
        columns = present_columns(rows)
        width = 0.8 / max(1, len(present))
        for i, contender in enumerate(present):
            values = [median(pick(rows, contender, op, cache, key)) for op, cache, _, key in columns]
            values = [float("nan") if v is None else v for v in values]
            ax.bar([j + i * width for j in range(len(columns))], values, width, label=contender)
        labels = [c[2].replace("`", "").replace(": ", ":\n") for c in columns]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))], labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (median, log scale)")
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


def repetitions(rows: list[dict[str, Any]]) -> str:
    """How many runs each figure is of ("3 runs", or "5 runs for saves and 3
    for loads")."""

    def count(saves: bool) -> int:
        return max((r.get("rep", 0) + 1 for r in rows if (r["op"] in ("save", "save_async")) == saves), default=0)

    def runs(n: int) -> str:
        return f"{n} run" if n == 1 else f"{n} runs"

    saves, loads = count(True), count(False)
    if saves and loads and saves != loads:
        return f"{runs(saves)} for saves and {loads} for loads"
    return runs(max(saves, loads))


def write(directory: str, command: str, docs: str = DOCS, *, with_chart: bool = True) -> None:
    """Rewrite the generated part of `docs/benchmarks.md` and the chart."""
    results = load_results(directory)
    if not results:
        return
    lines = ["<!-- generated by benchmarks/report.py: do not edit between these markers -->", ""]
    lines += [f"Command: `{command}`", "", *machine(directory), ""]
    lines += ["### Targets", "", "Medians of this run; the reference is measured in the same run.", ""]
    lines += [*targets(results), ""]
    for name, rows in results.items():
        loads = [r["loadavg"] for r in rows if "loadavg" in r]
        load_note = f"; 1-minute load average during the runs {min(loads):.1f} to {max(loads):.1f}" if loads else ""
        took = sum(r.get("job_seconds", 0.0) for r in rows)
        took_note = f"; the workload's {len(rows)} measurements took {took / 60:.1f} min in all" if took else ""
        lines += [f"### `{name}`: {state_description(rows)}", ""]
        lines += [f"Seconds, min / median of {repetitions(rows)}, each in a fresh process{load_note}{took_note}.", ""]
        lines += [*table(name, rows), ""]
        if failed_lines := failures(rows):
            lines += ["Failed measurements:", "", *failed_lines, ""]
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
