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

from . import foreign, run, workload

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")
WORKLOADS = ["large", "small", "many", "tiny", run.FOREIGN]
CONTENDERS = ["eqx_ckpt", "equinox", "orbax", "safetensors", "raw"]
# The `foreign` workload's ways of loading (`benchmarks/foreign.py`), and what they load.
FOREIGN_CONTENDERS = ["reference", "load_file", "eqx_ckpt", "checkpoint", "raw"]
FOREIGN_COLUMNS: list[tuple[str, str | None, str, str]] = [
    ("single", "warm", "one file of small tensors", "seconds"),
    ("hf", "warm", f"a directory of them ({foreign.SHARDS} shards)", "seconds"),
    ("large", "warm", "one large file", "seconds"),
]
# The ways eqx_ckpt loads a foreign file, both held to the targets.
FOREIGN_WAYS = [("eqx_ckpt", "`tree_deserialise_leaves`"), ("checkpoint", "`Checkpoint(path).load()`")]
# Issue 42: no run of a target's measurements worse than this times their median.
STABLE = 1.5
# (op, page cache, heading, result key): the columns of the detail tables.
COLUMNS = [
    ("save", None, "durable save", "seconds"),
    ("save_async", None, "`blocking=False`: call blocked", "blocked"),
    ("save_async", None, "`blocking=False`: floor (flatten + host views)", "floor"),
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


def present_columns(
    rows: list[dict[str, Any]], columns: list[tuple[str, str | None, str, str]] = COLUMNS
) -> list[tuple[str, str | None, str, str]]:
    """The columns some row measured (or failed to: results written before a
    column's key existed leave it out)."""
    return [
        c
        for c in columns
        if any(r["op"] == c[0] and r.get("cache") == c[1] and (c[3] in r or "error" in r) for r in rows)
    ]


def rss_added(rows: list[dict[str, Any]], contender: str) -> list[float]:
    """The peak RSS a full load added, cold and warm runs together."""
    return pick(rows, contender, "load", "cold", "rss_added") + pick(rows, contender, "load", "warm", "rss_added")


def table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """One Markdown table: min / median seconds per contender and operation
    (for a checkpoint workload, also the memory of a load and the files)."""
    checkpoints = name != run.FOREIGN
    names, columns = (CONTENDERS, COLUMNS) if checkpoints else (FOREIGN_CONTENDERS, FOREIGN_COLUMNS)
    present = [c for c in names if any(r["contender"] == c for r in rows)]
    columns = present_columns(rows, columns)
    head = ["contender", *[c[2] for c in columns]]
    if checkpoints:
        head += ["peak RSS added by a full load (median)", "files", "bytes on disk"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for contender in present:
        cells = [f"`{contender}`"]
        for op, cache, _, key in columns:
            cells.append(fmt_seconds(pick(rows, contender, op, cache, key), len(failed(rows, contender, op, cache))))
        if not checkpoints:
            lines.append("| " + " | ".join(cells) + " |")
            continue
        rss = rss_added(rows, contender)
        saves = [r for r in rows if r["contender"] == contender and r["op"] == "save" and "files" in r]
        cells.append(fmt_bytes(statistics.median(rss)) if rss else "–")
        cells.append(str(saves[-1]["files"]) if saves else "–")
        cells.append(fmt_bytes(saves[-1]["bytes"]) if saves else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per failed measurement, with the first line of its error."""
    headings = {(op, cache): heading for op, cache, heading, _ in COLUMNS + FOREIGN_COLUMNS}
    headings[("save_async", None)] = "`blocking=False` save"
    lines = []
    for r in rows:
        if "error" in r:
            what = headings.get((r["op"], r.get("cache")), r["op"])
            error = str(r["error"]).strip().splitlines()[0] if str(r["error"]).strip() else "?"
            lines.append(f"- `{r['contender']}`, {what}, run {r.get('rep', 0) + 1}: {error}")
    return lines


def worst_ratio(runs: list[float]) -> float | None:
    """The slowest of `runs` over their median (issue 42's stability rule)."""
    mid = median(runs)
    return max(runs) / mid if runs and mid else None


def target_row(
    number: int,
    name: str,
    label: str,
    runs: list[float],
    ref: float | None,
    ref_note: str,
    limit: float | None,
    *,
    statistic: Any = median,
    unit: str = "s",
    why_missing: str = "not measured",
) -> str:
    """A row of the targets table: `statistic` (the median) of eqx_ckpt's
    `runs`, the reference's median, their ratio, the worst run over the
    median, and whether the target is met (`limit=None`: informational): the
    ratio within `limit` and no run worse than `STABLE` times the median."""

    def show(value: float | None) -> str:
        if value is None:
            return "–"
        return fmt_bytes(value) if unit == "bytes" else f"{value:.3f} s"

    mine = statistic(runs) if runs else None
    worst = worst_ratio(runs)
    spread = "–" if worst is None else f"{worst:.2f}x"
    reference = f"{show(ref)} ({ref_note})"
    if mine is None or ref is None or ref <= 0:
        return f"| {number} | {name} | {label} | {show(mine)} | {reference} | – | {spread} | {why_missing} |"
    r = mine / ref
    if limit is None:
        met = "(informational)"
    elif r > limit:
        met = "no"
    elif worst is not None and worst > STABLE:
        met = f"no (a run over {STABLE}x the median)"
    else:
        met = "yes"
    return f"| {number} | {name} | {label} | {show(mine)} | {reference} | {r:.2f}x | {spread} | {met} |"


def missing(rows: list[dict[str, Any]], contender: str, op: str, cache: str | None) -> str:
    if not rows:
        return "not measured (workload not run)"
    return "not measured (failed)" if failed(rows, contender, op, cache) else "not measured"


def targets(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Issues 11's and 42's targets, each on the medians of one run, and below
    the table whether issue 42's stability rule holds for every target."""
    head = "| # | workload | target | eqx_ckpt (median) | reference (median) | ratio | worst / median | met |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    unstable: list[str] = []

    def add(
        number: int,
        name: str,
        label: str,
        runs: list[float],
        ref: float | None,
        note: str,
        limit: float | None,
        **kwargs: Any,
    ) -> None:
        lines.append(target_row(number, name, label, runs, ref, note, limit, **kwargs))
        worst = worst_ratio(runs)
        if limit is not None and worst is not None and worst > STABLE:
            unstable.append(f"{number} `{name}` {label} ({worst:.2f}x)")

    names = TARGET_WORKLOADS + [n for n in results if n not in TARGET_WORKLOADS and n != run.FOREIGN]
    # 1. Durable save and full loads at most as slow as the faster single-file format.
    first = (("save", None, "durable save"), ("load", "cold", "full load, cold"), ("load", "warm", "full load, warm"))
    for name in names:
        rows = results.get(name, [])
        for op, cache, what in first:
            runs = pick(rows, "eqx_ckpt", op, cache)
            refs = {c: m for c in SINGLE_FILE if (m := median(pick(rows, c, op, cache))) is not None}
            best = min(refs, key=lambda c: refs[c]) if refs else None
            note = f"`{best}`" if best else " / ".join(f"`{c}`" for c in SINGLE_FILE)
            label = f"{what} <= 1.0x the faster of {' and '.join(SINGLE_FILE)}"
            why = missing(rows, "eqx_ckpt", op, cache) if not runs else missing(rows, SINGLE_FILE[0], op, cache)
            add(1, name, label, runs, refs.get(best) if best else None, note, 1.0, why_missing=why)
    # 2. The large workload against the physical reference, and the memory of a load.
    rows = results.get("large", [])
    for op, cache, label, limit in (
        ("save", None, "durable save <= 1.1x raw (`writev` + `fsync`)", 1.1),
        ("load", "cold", "full load, cold <= 1.2x raw", 1.2),
        ("load", "warm", "full load, warm <= 1.5x raw", 1.5),
        ("params", "cold", "params-only load, cold <= 1.2x raw read of the params", 1.2),
    ):
        runs, ref = pick(rows, "eqx_ckpt", op, cache), median(pick(rows, "raw", op, cache))
        why = missing(rows, "raw" if runs else "eqx_ckpt", op, cache)
        add(2, "large", label, runs, ref, "`raw`", limit, why_missing=why)
    state = workload.state_bytes(workload.skeleton(workload.Sizes(**rows[0]["sizes"]))) if rows else None
    label = "peak RSS added by a full load <= 1.2x the state's bytes"
    why = missing(rows, "eqx_ckpt", "load", "cold")
    add(2, "large", label, rss_added(rows, "eqx_ckpt"), state, "the state's bytes", 1.2, unit="bytes", why_missing=why)
    # 3. An asynchronous save blocks the caller for a tenth of a synchronous
    # one, or for little more than what any such call must do (issue 42).
    for name in names:
        rows = results.get(name, [])
        blocked = pick(rows, "eqx_ckpt", "save_async", None, "blocked")
        bound, note = async_bound(rows)
        label = "`blocking=False` blocks the caller <= max(10% of a synchronous save, 1.25x the floor)"
        why = missing(rows, "eqx_ckpt", "save_async" if not blocked else "save", None)
        add(3, name, label, blocked, bound, note, 1.0, why_missing=why)
    # 4. Partial loads: no regression (no bound of their own); params-only loads
    # against raw's read of the same bytes, so runs can be compared.
    for name in names:
        rows = results.get(name, [])
        measured = {r["op"] for r in rows}
        for cache in ("cold", "warm"):
            if f"params_{cache}" not in run.OPS.get(name, []) and "params" not in measured:
                continue
            runs, ref = pick(rows, "eqx_ckpt", "params", cache), median(pick(rows, "raw", "params", cache))
            label = f"params-only load, {cache}: no regression"
            why = missing(rows, "raw" if runs else "eqx_ckpt", "params", cache)
            add(4, name, label, runs, ref, "`raw`", None, why_missing=why)
        if "open_cold" in run.OPS.get(name, []) or "open" in measured:
            opens = pick(rows, "eqx_ckpt", "open", "cold") + pick(rows, "eqx_ckpt", "open", "warm")
            label = "lazy open (`eqx_ckpt.Checkpoint`, worst run) <= 1 s, as before: no regression"
            why = missing(rows, "eqx_ckpt", "open", "cold")
            add(4, name, label, opens, 1.0, "bound", 1.0, statistic=max, why_missing=why)
    # 5. Foreign files, loaded both ways eqx_ckpt offers (issue 42).
    rows = results.get(run.FOREIGN, [])
    count = f"{rows[0]['tensors']:,}" if rows else "10,000"
    large = [r["bytes"] for r in rows if r["op"] == "large" and "bytes" in r]
    cases = (
        ("single", f"one safetensors file of {count} small tensors", "reference", 2.0, "`load_file` + `jnp.asarray`"),
        ("hf", f"a Hugging Face directory of {count} small tensors", "reference", 2.0, "`load_file` + `jnp.asarray`"),
        ("large", f"a {fmt_bytes(large[0]) if large else '3 GiB'} safetensors file", "raw", 1.2, "raw reads of it"),
    )
    for case, what, base, limit, base_note in cases:
        ref = median(pick(rows, base, case, "warm"))
        for way, how in FOREIGN_WAYS:
            runs = pick(rows, way, case, "warm")
            why = missing(rows, base if runs else way, case, "warm")
            add(
                5, run.FOREIGN, f"{what}, {how} <= {limit}x {base_note}", runs, ref, f"`{base}`", limit, why_missing=why
            )
    verdict = "holds for every measured target." if not unstable else "does not hold for " + "; ".join(unstable) + "."
    rule = f"Stability (issue 42: no run of eqx_ckpt's worse than {STABLE}x the median of its runs): {verdict}"
    return [*lines, "", rule]


def async_bound(rows: list[dict[str, Any]]) -> tuple[float | None, str]:
    """What an asynchronous save may block its caller for, and which bound that
    is: the larger of 10% of the synchronous save and 1.25x the floor (what
    any such call must do: flatten the tree, one host view per array;
    `benchmarks/worker.py:hold_floor`), medians of the same run."""
    sync = median(pick(rows, "eqx_ckpt", "save", None))
    floor = median(pick(rows, "eqx_ckpt", "save_async", None, "floor"))
    if sync is None:
        return None, "10% of `eqx_ckpt`'s synchronous save, or 1.25x the floor"
    tenth = f"10% of the synchronous save, {0.1 * sync:.3f} s"
    if floor is None:
        return 0.1 * sync, f"{tenth}; the floor not measured"
    lifted = f"1.25x the floor of {floor:.3f} s, {1.25 * floor:.3f} s"
    if 1.25 * floor > 0.1 * sync:
        return 1.25 * floor, f"{lifted}, applies; {tenth}"
    return 0.1 * sync, f"{tenth}, applies; {lifted}"


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

    # The foreign workload's loads are in its own table only.
    names = [n for n in WORKLOADS if n in results and n not in ("tiny", run.FOREIGN)]
    names = names or [n for n in results if n != run.FOREIGN]
    if not names:
        return
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
    if rows[0]["workload"] == run.FOREIGN:
        large = [r["bytes"] for r in rows if r["op"] == "large" and "bytes" in r]
        count = f"{rows[0]['tensors']:,} small float32 tensors"
        files = f"{count} in one safetensors file and in a directory of {foreign.SHARDS} shards"
        return files + (f", and one {fmt_bytes(large[0])} file" if large else "")
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
    lines += ["### Targets", "", "Medians of this run; the reference is measured in the same run. "]
    lines[-1] += (
        f"`worst / median`: eqx_ckpt's slowest run over the median of its runs; a target is met when the "
        f"ratio is within its bound and no run is worse than {STABLE}x the median."
    )
    lines.append("")
    lines += [*targets(results), ""]
    for name, rows in results.items():
        loads = [r["loadavg"] for r in rows if "loadavg" in r]
        load_note = f"; 1-minute load average during the runs {min(loads):.1f} to {max(loads):.1f}" if loads else ""
        took = sum(r.get("job_seconds", 0.0) for r in rows)
        took_note = f"; the workload's {len(rows)} measurements took {took / 60:.1f} min in all" if took else ""
        lines += [f"### `{name}`: {state_description(rows)}", ""]
        warm = ", page cache warm" if name == run.FOREIGN else ""
        runs = f"Seconds, min / median of {repetitions(rows)}, each in a fresh process{warm}"
        lines += [f"{runs}{load_note}{took_note}.", ""]
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
