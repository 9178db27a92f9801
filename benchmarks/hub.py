"""Fetching a model from the Hugging Face Hub by name, against a local Hub server.

`python -m benchmarks.hub [--mib 1024] [--reps 3] [--shards 2] [--tree PATH]`

Starts the local server the tests use (`tests/support/hub_server.py`, in a thread of
this process; the loads run in other processes), publishes a model of `--mib`
MiB (float32 tensors of 16 MiB, and a few small ones) with
`eqx_ckpt.push_to_hub`, then times, each measurement in a fresh process with
an empty Hugging Face cache (imports and JAX's start-up not timed, nor
`huggingface_hub`'s import, which eqx_ckpt makes at its first Hub call):

- `reference`: `huggingface_hub.snapshot_download` of the repository, then
  `safetensors.numpy.load_file` of each file and `jnp.asarray` of each tensor
  (what a user does without eqx_ckpt);
- `eqx_ckpt`: `eqx_ckpt.tree_deserialise_leaves("hf://bench/model", like)`,
  `like` a tree of `jax.ShapeDtypeStruct`s (downloads into the same cache,
  then loads);
- `second`: the same load again, in a fresh process with the cache the
  `eqx_ckpt` run filled (it must send no file bytes);
- `checkpoint`: `eqx_ckpt.Checkpoint("hf://bench/model").load(trust=[])`, the
  load without `like` (`from_pretrained`), into an empty cache;
- `download`: `snapshot_download` alone (the bytes a whole load must fetch);
- `partial`: the same load with `prefix=` one 16 MiB tensor (byte ranges:
  the headers and that tensor).

Prints, for each, the median and worst of `--reps` runs, the bytes the server
sent (the file contents, per run), and the ratio of each median to the
reference's. Every load's values are checked against what was published.
`--tree PATH` measures the eqx_ckpt of another checkout (its source folder
first on `PYTHONPATH` of the timed processes; the push is this checkout's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
TENSOR = (2048, 2048)  # 16 MiB of float32
OPS = ("reference", "eqx_ckpt", "second", "checkpoint", "download", "partial")
REPO = "bench/model"

_PRELUDE = """
import json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
"""
_CODE = {
    "reference": """
import huggingface_hub, safetensors.numpy
start = time.perf_counter()
folder = huggingface_hub.snapshot_download(REPO)
out = {}
for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
        out.update({k: jnp.asarray(v) for k, v in safetensors.numpy.load_file(os.path.join(folder, name)).items()})
jax.block_until_ready(out)
seconds = time.perf_counter() - start
check = float(out["big.3"][0, 0])
""",
    "eqx_ckpt": """
import eqx_ckpt, huggingface_hub
like = {"big": [jax.ShapeDtypeStruct(SHAPE, jnp.float32)] * BIG,
        "small": [jax.ShapeDtypeStruct((64,), jnp.float32)] * 8}
start = time.perf_counter()
out = eqx_ckpt.tree_deserialise_leaves("hf://" + REPO, like)
jax.block_until_ready(out)
seconds = time.perf_counter() - start
check = float(out["big"][3][0, 0])
""",
    "checkpoint": """
import eqx_ckpt, huggingface_hub
start = time.perf_counter()
out = eqx_ckpt.Checkpoint("hf://" + REPO).load(trust=[])
jax.block_until_ready(out)
seconds = time.perf_counter() - start
check = float(out["big"][3][0, 0])
""",
    "download": """
import huggingface_hub
start = time.perf_counter()
huggingface_hub.snapshot_download(REPO)
seconds = time.perf_counter() - start
check = 3.0
""",
    "partial": """
import eqx_ckpt, huggingface_hub
start = time.perf_counter()
out = eqx_ckpt.tree_deserialise_leaves("hf://" + REPO, jax.ShapeDtypeStruct(SHAPE, jnp.float32), prefix="big.3")
jax.block_until_ready(out)
seconds = time.perf_counter() - start
check = float(out[0, 0])
""",
}


def model(mib: int) -> dict[str, Any]:
    """`mib` MiB in 16 MiB float32 tensors (tensor i holds i everywhere), and 8 small ones."""
    big = max(4, mib * 2**20 // (np.prod(TENSOR) * 4))
    return {
        "big": [np.full(TENSOR, float(i), np.float32) for i in range(big)],
        "small": [np.arange(64, dtype=np.float32) + i for i in range(8)],
    }


@contextlib.contextmanager
def hub(directory: str) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """The local Hub server, and the environment of a process that reaches it."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import hub_server

    with hub_server.serving() as (url, state):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(
            HF_ENDPOINT=url,
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_TOKEN="bench",
            JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        yield url, state, env


def run_in(env: dict[str, str], code: str, home: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + code + '\nprint("RESULT " + json.dumps([seconds, check]))'],
        env={**env, "HF_HOME": home},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-4000:])
    seconds, check = json.loads(lines[-1][len("RESULT ") :])
    return {"seconds": seconds, "check": check}


def publish(env: dict[str, str], tree_dir: str, mib: int, shards: int) -> None:
    """Save the model as a local checkpoint here, then push it from another process."""
    import eqx_ckpt

    eqx_ckpt.tree_serialise_leaves(tree_dir, model(mib))
    shard = f"{max(1, -(-mib // shards))}MiB"
    code = f"import eqx_ckpt\nprint(eqx_ckpt.push_to_hub({tree_dir!r}, {REPO!r}, max_shard_size={shard!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "HF_HOME": tree_dir + "-hf"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])


_CODE["second"] = _CODE["eqx_ckpt"]


def bench(mib: int, reps: int, shards: int, tree: str | None = None) -> list[dict[str, Any]]:
    """Every op, `reps` times each, each rep in a fresh process with an empty
    cache (`second`: the cache `eqx_ckpt` filled)."""
    big = max(4, mib * 2**20 // (np.prod(TENSOR) * 4))
    rows = []
    with tempfile.TemporaryDirectory(prefix="eqx_ckpt-bench-hub-") as directory, hub(directory) as (_, state, env):
        publish(env, os.path.join(directory, "model"), mib, shards)
        if tree is not None:
            env = {**env, "PYTHONPATH": os.pathsep.join([os.path.abspath(tree), env["PYTHONPATH"]])}
        for rep in range(reps):
            for op in OPS:
                code = _CODE[op].replace("REPO", repr(REPO)).replace("SHAPE", repr(TENSOR)).replace("BIG", str(big))
                before = state.sent.get("", 0)
                home = os.path.join(directory, f"hf-{'eqx_ckpt' if op == 'second' else op}-{rep}")
                row = run_in(env, code, home)
                row.update(op=op, rep=rep, sent=state.sent.get("", 0) - before)
                if row["check"] != 3.0:
                    raise AssertionError(f"{op} loaded {row['check']} where 3.0 was published")
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    reference = statistics.median(r["seconds"] for r in rows if r["op"] == "reference")
    lines = ["| op | median s | worst s | vs reference | bytes sent (MiB) |", "|---|---:|---:|---:|---:|"]
    for op in OPS:
        times = [r["seconds"] for r in rows if r["op"] == op]
        sent = statistics.median(r["sent"] for r in rows if r["op"] == op)
        median = statistics.median(times)
        lines.append(f"| {op} | {median:.2f} | {max(times):.2f} | {median / reference:.2f}x | {sent / 2**20:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="the model's size in MiB")
    parser.add_argument("--reps", type=int, default=3, help="runs of each op")
    parser.add_argument("--shards", type=int, default=2, help="safetensors files the model is published in")
    parser.add_argument("--tree", default=None, help="another checkout whose eqx_ckpt the loads measure")
    args = parser.parse_args(argv)
    rows = bench(args.mib, args.reps, args.shards, args.tree)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
