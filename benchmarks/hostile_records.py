"""What a hostile manifest costs a load: peak memory and seconds (issue 59).

`python -m benchmarks.hostile_records [--mb 64] [--nodes 4000000]`

Each case runs in a fresh process, which reports its peak RSS
(`ru_maxrss`) and the seconds the load took, error or not:

- `baseline`: an ordinary load with `like` of a sound one-leaf checkpoint;
- `lists`: the same load, the manifest grown to `--mb` MB by a metric of
  `[],` repeated (millions of empty JSON arrays);
- `dense`: the same, with `[123456],` repeated instead: the densest
  containers a manifest may hold (one in 6 bytes and more), which are parsed;
- `nodes`: `Checkpoint(path).skeleton(trust=[])` of the checkpoint whose
  structure record is a list of `--nodes` tiny nodes (`{"t":"none"}`)
  beside its one stored leaf.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import eqx_ckpt

_CHILD = """
import resource, sys, time
import numpy as np
import eqx_ckpt
case, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
try:
    if case == "nodes":
        eqx_ckpt.Checkpoint(path).skeleton(trust=[])
    else:
        eqx_ckpt.tree_deserialise_leaves(path, {"w": np.zeros(3)})
    outcome = "loaded"
except eqx_ckpt.CheckpointError as e:
    outcome = type(e).__name__ + " (" + str(e)[:160].replace("\\n", " ") + "...)"
print(case, outcome, f"{time.perf_counter() - start:.2f} s",
      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB peak RSS")
"""


def _sign(data: bytes) -> bytes:
    """`data`, a manifest whose content changed, with its digest made again."""
    head = data[: data.rindex(b',\n"digest": ')]
    return head + b',\n"digest": "sha256:' + hashlib.sha256(head).hexdigest().encode() + b'"}\n'


def _checkpoints(root: Path, mb: int, nodes: int) -> dict[str, Path]:
    eqx_ckpt.tree_serialise_leaves(root / "baseline", {"w": np.arange(3.0)})
    data = (root / "baseline" / "manifest.json").read_bytes()
    out = {"baseline": root / "baseline"}
    # A metric of `[],` repeated, in place of the empty metrics.
    lists = b'"metrics": {"junk": [' + b"[]," * (mb * 2**20 // 3) + b"[]]}"
    (root / "lists").mkdir()
    (root / "lists" / "manifest.json").write_bytes(_sign(data.replace(b'"metrics": {}', lists, 1)))
    record = '{"t":"dict","k":[["key","w"],["key","n"]],"c":[{"t":"leaf"},{"t":"list","c":['
    record += ",".join(['{"t":"none"}'] * nodes) + "]}]}"
    start = data.index(b'"structure": ') + len(b'"structure": ')
    end = data.index(b',\n"leaves": ')
    (root / "nodes").mkdir()
    (root / "nodes" / "manifest.json").write_bytes(_sign(data[:start] + json.dumps(record).encode() + data[end:]))
    dense = b'"metrics": {"junk": [' + b"[123456]," * (mb * 2**20 // 9) + b"[]]}"
    (root / "dense").mkdir()
    (root / "dense" / "manifest.json").write_bytes(_sign(data.replace(b'"metrics": {}', dense, 1)))
    for name in ("lists", "dense", "nodes"):
        for item in (root / "baseline").iterdir():
            if item.name != "manifest.json":
                _copy(item, root / name / item.name)
    return out | {name: root / name for name in ("lists", "dense", "nodes")}


def _copy(source: Path, target: Path) -> None:
    import shutil

    (shutil.copytree if source.is_dir() else shutil.copy)(source, target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=4_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for case, path in _checkpoints(Path(tmp), args.mb, args.nodes).items():
            size = (path / "manifest.json").stat().st_size / 2**20
            done = subprocess.run([sys.executable, "-c", _CHILD, case, str(path)], capture_output=True, text=True)
            print(f"{done.stdout.strip() or done.stderr.strip()[-400:]} (manifest {size:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main()
