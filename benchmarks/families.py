"""Model families: fine-tunes published against a base, against a local Hub server.

`python -m benchmarks.families [--mib 256] [--reps 3] [--finetunes 10]`

Starts the local server the tests use (`tests/support/hub_server.py`, in a thread of
this process), as `benchmarks.hub` does. The base is `--mib` MiB of float32
body tensors of 16 MiB (tensor i holds i everywhere) and a head: a 1 MiB
weight and a 1 KiB bias. Fine-tune i keeps the body and changes the head
(other random values). Its changed bytes are the head's.

A process pushes, one after another: the base; each fine-tune with
`base="hf://bench/base"` (`bench/ft-i`); the same fine-tune whole, with
`standalone=True` (`bench/whole-i`). Then it measures, in one run:

1. `upload`, `stored`: the bytes the server received for each push (its
   `received`: LFS uploads and files inline in commits), and the bytes of
   the repository's files at its commit. A fine-tune against the whole
   model, over the `--finetunes` pushes; target: at most the changed bytes
   plus 1 MiB.
2. `cache`: every fine-tune loaded whole once into one fresh Hugging Face
   cache (`HF_HOME`), one process loading them one after another; the bytes
   of the files under `HF_HOME` afterwards (each file once: blobs, not the
   links to them). Against the standalone copies loaded into another fresh
   cache. Target: at most the base's repository, plus every fine-tune's
   changed bytes, plus 10 MiB.
3. Loads of `bench/ft-0` (`tree_deserialise_leaves("hf://...", like)`), each
   in a fresh process (imports and JAX's start-up not timed, as in
   `benchmarks.hub`), `--reps` times, the order alternating:
   - `warm base`: its base already cached, the fine-tune not; against the
     standalone copy loaded from a cache in the same state (the base
     cached, the copy not);
   - `both cached`: the same load again, from the cache the first filled;
     against the standalone copy's second load;
   - `cold`: an empty cache; against `huggingface_hub.snapshot_download` of
     the base and the fine-tune, then `safetensors.numpy.load_file` of each
     file and `jnp.asarray` of each tensor (the fine-tune's replacing the
     base's). The standalone copy's cold load is shown beside, untargeted.
   Target: at most 1.1x.
4. `export`: `export_safetensors` of the fine-tune's tree (numpy arrays) in
   this process, with `base=` a local published folder of the base, against
   without; hashing included, `--reps` times each, the order alternating.
   Target: at most 1.2x. `export stored`: the bytes of the two folders
   (target: the changed bytes plus 1 MiB).
5. `local checkpoint base`: the fine-tune exported against an eqx_ckpt
   checkpoint of the base beside it (`tree_serialise_leaves`), loaded whole
   in this process, its taken leaves read from the checkpoint's chunks;
   against its standalone export. Page cache warm (one untimed load of
   each first), `--reps` times each, the order alternating. Target: at most
   1.1x.

Every load's values are checked bit for bit against what was pushed (a
digest of every tensor's name, dtype, shape and bytes) before its time is
kept. Prints each measurement's median and worst, its comparison's median,
the ratio, the target and whether it is met; `main` returns these rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
import xxhash

from benchmarks import hub

TENSOR = hub.TENSOR  # 16 MiB of float32
HEAD = (1024, 256)  # 1 MiB of float32, and a bias of 1 KiB
BASE = "bench/base"
MIB = 2**20

_PUSHER = """
import json, sys
import eqx_ckpt
from benchmarks.families import model
for line in sys.stdin:
    job = json.loads(line)
    tree = model(job["big"], tuple(job["tensor"]), tuple(job["head"]), job["finetune"])
    commit = eqx_ckpt.push_to_hub(tree, job["repo"], base=job["base"], standalone=job["standalone"])
    print("DONE " + json.dumps(commit), flush=True)
"""
_LOAD = """
import eqx_ckpt, huggingface_hub
from benchmarks.families import fingerprint, like
template = like(BIG, SHAPE, HEAD)
out, start = [], time.perf_counter()
for repo in REPOS:
    out.append(eqx_ckpt.tree_deserialise_leaves("hf://" + repo, template))
    jax.block_until_ready(out[-1])
seconds = time.perf_counter() - start
check = [fingerprint(tree) for tree in out]
"""
_REFERENCE = """
import huggingface_hub, safetensors.numpy
from benchmarks.families import fingerprint
start = time.perf_counter()
out = {}
for repo in REPOS:
    folder = huggingface_hub.snapshot_download(repo)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update({k: jnp.asarray(v) for k, v in safetensors.numpy.load_file(os.path.join(folder, name)).items()})
jax.block_until_ready(out)
seconds = time.perf_counter() - start
check = [fingerprint(out)]
"""


def model(big: int, tensor: tuple[int, ...], head: tuple[int, int], finetune: int | None) -> dict[str, Any]:
    """The base (`finetune=None`), or fine-tune `finetune`: the same body, another head."""
    rng = np.random.default_rng(0 if finetune is None else finetune + 1)
    return {
        "body": [np.full(tensor, float(i), np.float32) for i in range(big)],
        "head": {
            "w": rng.standard_normal(head, np.float32),
            "b": rng.standard_normal(head[1:], np.float32),
        },
    }


def like(big: int, tensor: tuple[int, ...], head: tuple[int, int]) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model(big, tensor, head, None))


def fingerprint(tree: Any) -> str:
    """A digest of every tensor: its dotted name, dtype, shape and bytes (a
    tree and the flat dict of its safetensors names give the same)."""
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        named[name] = np.asarray(leaf)
    digest = xxhash.xxh3_128()
    for name in sorted(named):
        value = named[name]
        digest.update(f"{name} {value.dtype} {value.shape}\n".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def changed_bytes(base: dict[str, Any], tree: dict[str, Any]) -> int:
    """The bytes of the leaves of `tree` that differ from the base's leaf of the same name."""
    pairs = zip(jax.tree.leaves(base), jax.tree.leaves(tree))
    return sum(b.nbytes for a, b in pairs if a.tobytes() != b.tobytes())


def disk_bytes(folder: str) -> int:
    """The bytes of the files under `folder`, each file once (links not followed)."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if not os.path.islink(os.path.join(root, name)) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def repo_bytes(state: Any, repo: str) -> int:
    """The bytes of a repository's files at its commit on `main`, on the server."""
    entry = state.repos[repo]
    return sum(len(state.blobs[oid]) for oid in entry.commits[entry.branches["main"]].values())


class Pusher:
    """One process that pushes one tree at a time, so the server's count of
    bytes received can be read between pushes."""

    def __init__(self, env: dict[str, str], home: str, sizes: dict[str, Any]) -> None:
        self.sizes = sizes
        self.log = open(home + ".log", "w+")  # closed by `close`
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PUSHER],
            env={**env, "HF_HOME": home},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def push(self, repo: str, finetune: int | None, *, base: str | None = None, standalone: bool = False) -> None:
        job = {**self.sizes, "repo": repo, "finetune": finetune, "base": base, "standalone": standalone}
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("DONE "):
                return
        self.log.seek(0)
        raise RuntimeError(f"pushing {repo} failed:\n{self.log.read()[-4000:]}")

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.log.close()


class Bench:
    """The server, the sizes, and the checked loads."""

    def __init__(self, directory: str, state: Any, env: dict[str, str], mib: int, finetunes: int) -> None:
        self.directory, self.state, self.env, self.finetunes = directory, state, env, finetunes
        self.big = max(4, mib * MIB // (int(np.prod(TENSOR)) * 4))
        self.sizes = {"big": self.big, "tensor": list(TENSOR), "head": list(HEAD)}
        self.base = model(self.big, TENSOR, HEAD, None)
        self.expected = {BASE: fingerprint(self.base)}
        self.changed: list[int] = []
        for i in range(finetunes):
            tree = model(self.big, TENSOR, HEAD, i)
            self.expected[f"bench/ft-{i}"] = self.expected[f"bench/whole-{i}"] = fingerprint(tree)
            self.changed.append(changed_bytes(self.base, tree))
        self.checked = 0

    def load(self, home: str, repos: list[str], *, reference: bool = False) -> float:
        """Seconds of a load of `repos` in a fresh process with `HF_HOME=home`,
        its values checked (the reference: one tree of all `repos`, the last one's)."""
        code = (_REFERENCE if reference else _LOAD).replace("REPOS", repr(repos)).replace("BIG", str(self.big))
        code = code.replace("SHAPE", repr(TENSOR)).replace("HEAD", repr(HEAD))
        row = hub.run_in(self.env, code, os.path.join(self.directory, home))
        expected = [self.expected[repos[-1]]] if reference else [self.expected[r] for r in repos]
        if row["check"] != expected:
            raise AssertionError(f"loading {repos} into {home} gave other values than were pushed")
        self.checked += len(expected)
        return float(row["seconds"])

    def copy(self, home: str, to: str) -> None:
        shutil.copytree(os.path.join(self.directory, home), os.path.join(self.directory, to), symlinks=True)


def row(
    measure: str,
    unit: str,
    values: list[float],
    versus: str,
    against: list[float],
    target: str,
    limit: float,
    *,
    ratio_limit: bool = False,
) -> dict[str, Any]:
    """One measurement beside its comparison; `limit` bounds its median (or,
    with `ratio_limit`, the ratio of the medians)."""
    median, theirs = statistics.median(values), statistics.median(against) if against else float("nan")
    ratio = median / theirs if against else float("nan")
    return {
        "measure": measure,
        "unit": unit,
        "values": values,
        "median": median,
        "worst": max(values),
        "versus": versus,
        "versus_median": theirs,
        "ratio": ratio,
        "target": target,
        "met": (ratio if ratio_limit else max(values)) <= limit if limit == limit else None,
    }


def pushes(bench: Bench) -> list[dict[str, Any]]:
    """Item 1: the base, then each fine-tune against it and whole."""
    sent: dict[str, list[float]] = {"ft": [], "whole": []}
    pusher = Pusher(bench.env, os.path.join(bench.directory, "hf-pusher"), bench.sizes)
    try:
        pusher.push(BASE, None)
        for i in range(bench.finetunes):
            for kind, options in (("ft", {"base": "hf://" + BASE}), ("whole", {"standalone": True})):
                before = bench.state.received
                pusher.push(f"bench/{kind}-{i}", i, **options)
                sent[kind].append(bench.state.received - before)
    finally:
        pusher.close()
    stored = {k: [repo_bytes(bench.state, f"bench/{k}-{i}") for i in range(bench.finetunes)] for k in sent}
    limit = max(bench.changed) + MIB
    target = f"<= changed + 1 MiB ({limit / MIB:.2f} MiB)"
    return [
        row("upload, `base=`", "MiB", sent["ft"], "upload, whole", sent["whole"], target, limit),
        row("stored, `base=`", "MiB", stored["ft"], "stored, whole", stored["whole"], target, limit),
    ]


def caches(bench: Bench) -> list[dict[str, Any]]:
    """Item 2: every fine-tune loaded whole into one fresh cache."""
    n = bench.finetunes
    bench.load("hf-family", [f"bench/ft-{i}" for i in range(n)])
    bench.load("hf-wholes", [f"bench/whole-{i}" for i in range(n)])
    limit = repo_bytes(bench.state, BASE) + sum(bench.changed) + 10 * MIB
    used = [disk_bytes(os.path.join(bench.directory, h)) for h in ("hf-family", "hf-wholes")]
    target = f"<= base + changes + 10 MiB ({limit / MIB:.1f} MiB)"
    return [row(f"cache, {n} fine-tunes", "MiB", used[:1], f"cache, {n} standalone", used[1:], target, limit)]


def loads(bench: Bench, reps: int) -> list[dict[str, Any]]:
    """Item 3: `bench/ft-0` and `bench/whole-0` from caches in the same states."""
    bench.load("hf-warm", [BASE])  # the base cached, copied below for each load
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        kinds = ["ft", "whole"] if rep % 2 == 0 else ["whole", "ft"]
        for kind in kinds:
            home = f"hf-{kind}-{rep}"
            bench.copy("hf-warm", home)
            times.setdefault(f"warm {kind}", []).append(bench.load(home, [f"bench/{kind}-0"]))
        for kind in kinds:
            times.setdefault(f"both {kind}", []).append(bench.load(f"hf-{kind}-{rep}", [f"bench/{kind}-0"]))
        for kind in [*kinds, "reference"]:
            repos = [BASE, "bench/ft-0"] if kind == "reference" else [f"bench/{kind}-0"]
            home = f"hf-cold-{kind}-{rep}"
            times.setdefault(f"cold {kind}", []).append(bench.load(home, repos, reference=kind == "reference"))
        for kind in [*kinds, "reference"]:  # the caches of this rep: not needed again
            for home in (f"hf-{kind}-{rep}", f"hf-cold-{kind}-{rep}"):
                shutil.rmtree(os.path.join(bench.directory, home), ignore_errors=True)
    target = "<= 1.1x"
    return [
        row("load, warm base", "s", times["warm ft"], "standalone, same cache", times["warm whole"], target, 1.1,
            ratio_limit=True),
        row("load, both cached", "s", times["both ft"], "standalone, cached", times["both whole"], target, 1.1,
            ratio_limit=True),
        row("load, cold", "s", times["cold ft"], "snapshot_download x2 + load_file", times["cold reference"], target,
            1.1, ratio_limit=True),
        row("load standalone, cold", "s", times["cold whole"], "snapshot_download x2 + load_file",
            times["cold reference"], "-", float("nan")),
    ]  # fmt: skip


def exports(bench: Bench, reps: int) -> list[dict[str, Any]]:
    """Item 4: an export against a local published base, and without, in this process."""
    import eqx_ckpt

    base = os.path.join(bench.directory, "export-base")
    eqx_ckpt.export_safetensors(base, bench.base)
    tree = model(bench.big, TENSOR, HEAD, 0)
    template = like(bench.big, TENSOR, HEAD)
    times: dict[str, list[float]] = {"base": [], "whole": []}
    stored: dict[str, int] = {}
    for rep in range(reps):
        for kind in ("base", "whole") if rep % 2 == 0 else ("whole", "base"):
            folder = os.path.join(bench.directory, f"export-{kind}-{rep}")
            start = time.perf_counter()
            eqx_ckpt.export_safetensors(folder, tree, **({"base": base} if kind == "base" else {}))
            times[kind].append(time.perf_counter() - start)
            if fingerprint(eqx_ckpt.tree_deserialise_leaves(folder, template)) != bench.expected["bench/ft-0"]:
                raise AssertionError(f"the export {folder} loads other values than were exported")
            bench.checked += 1
            stored[kind] = disk_bytes(folder)
            shutil.rmtree(folder)
    limit = bench.changed[0] + MIB
    return [
        row("export, `base=`", "s", times["base"], "export, whole", times["whole"], "<= 1.2x", 1.2, ratio_limit=True),
        row("export stored, `base=`", "MiB", [stored["base"]], "export stored, whole", [stored["whole"]],
            f"<= changed + 1 MiB ({limit / MIB:.2f} MiB)", limit),
    ]  # fmt: skip


def local_loads(bench: Bench, reps: int) -> list[dict[str, Any]]:
    """Item 5: a fine-tune against a local eqx_ckpt checkpoint base, and its standalone export, in this process."""
    import eqx_ckpt

    folders = {kind: os.path.join(bench.directory, f"local-{kind}") for kind in ("base", "ft", "whole")}
    eqx_ckpt.tree_serialise_leaves(folders["base"], bench.base)
    tree, template = model(bench.big, TENSOR, HEAD, 0), like(bench.big, TENSOR, HEAD)
    eqx_ckpt.export_safetensors(folders["ft"], tree, base=folders["base"])
    eqx_ckpt.export_safetensors(folders["whole"], tree)
    times: dict[str, list[float]] = {"ft": [], "whole": []}
    for rep in range(reps + 1):  # the first untimed: the page cache warmed
        for kind in ("ft", "whole") if rep % 2 == 0 else ("whole", "ft"):
            start = time.perf_counter()
            out = jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(folders[kind], template))
            seconds = time.perf_counter() - start
            if fingerprint(out) != bench.expected["bench/ft-0"]:
                raise AssertionError(f"{folders[kind]} loads other values than were exported")
            bench.checked += 1
            if rep:
                times[kind].append(seconds)
    return [
        row("load, local checkpoint base", "s", times["ft"], "standalone, local", times["whole"], "<= 1.1x", 1.1,
            ratio_limit=True),
    ]  # fmt: skip


def bench_all(mib: int, reps: int, finetunes: int) -> tuple[list[dict[str, Any]], int]:
    """Every measurement, and the number of loads whose values were checked."""
    with tempfile.TemporaryDirectory(prefix="eqx_ckpt-bench-families-") as directory:
        with hub.hub(directory) as (_, state, env):
            bench = Bench(directory, state, env, mib, finetunes)
            rows = pushes(bench) + caches(bench) + loads(bench, reps) + exports(bench, reps) + local_loads(bench, reps)
        return rows, bench.checked


def table(rows: list[dict[str, Any]]) -> str:
    def shown(value: float, unit: str) -> str:
        return "-" if value != value else f"{value / MIB:.2f}" if unit == "MiB" else f"{value:.2f}"

    lines = [
        "| measurement | unit | median | worst | comparison | its median | ratio | target | met |",
        "|---|---|---:|---:|---|---:|---:|---|---|",
    ]
    for r in rows:
        met = "-" if r["met"] is None else "met" if r["met"] else "NOT MET"
        ratio = "-" if r["ratio"] != r["ratio"] else f"{r['ratio']:.3f}x"
        lines.append(
            f"| {r['measure']} | {r['unit']} | {shown(r['median'], r['unit'])} | {shown(r['worst'], r['unit'])} "
            f"| {r['versus']} | {shown(r['versus_median'], r['unit'])} | {ratio} | {r['target']} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="the base's size in MiB")
    parser.add_argument("--reps", type=int, default=3, help="runs of each timed load and export")
    parser.add_argument("--finetunes", type=int, default=10, help="fine-tunes of the base pushed and cached")
    args = parser.parse_args(argv)
    rows, checked = bench_all(args.mib, args.reps, args.finetunes)
    for r in rows:
        r["checked"] = checked
    print(table(rows))
    print(f"{checked} loads checked bit for bit against what was pushed or exported.")
    return rows


if __name__ == "__main__":
    main()
