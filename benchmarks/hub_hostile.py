"""What a hostile Hub server costs a load, against the local Hub server.

`python -m benchmarks.hub_hostile [--only NAME ...]`

Each figure is measured in a fresh process with an empty cache (time from the
call to its answer, and the process's peak RSS over its start, both printed):

- `headers`: `Checkpoint("hf://...")` of 4 shards, each a 16 MB header of
  250,000 one-byte tensors;
- `index`: a load of a repository whose index is listed (and served) at 127 MB;
- `gzip`: `Checkpoint` of a repository whose range answers are 1 MB of gzip
  that inflates to 1 GB (`Content-Encoding: gzip`);
- `stalled`: `Checkpoint` of a server that accepts and never answers;
- `shards`: `Checkpoint` of 2,000 shards of one 16-byte tensor each (under
  `MAX_SHARDS`: every header is read);
- `shards_10k`: the same with 10,000 shards (over `MAX_SHARDS`: refused).

Every outcome must be an eqx_ckpt error (or a load); the line says which.
`--tree PATH` measures the eqx_ckpt of another checkout (the figures before a change).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import hub_server  # noqa: E402

_CODE = """
import resource, time, json
import eqx_ckpt, huggingface_hub
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    c = eqx_ckpt.Checkpoint({path!r})
    {then}
    said = "opened"
except Exception as e:
    said = type(e).__module__ + "." + type(e).__name__ + ": " + str(e)[:160]
took = time.perf_counter() - start
print("RESULT " + json.dumps([took, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024, said]))
"""


def safetensors(tensors: dict[str, bytes]) -> bytes:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(tensors.values())


def many(count: int, shard: int) -> bytes:
    return safetensors({f"s{shard}.t{i}": b"\0" for i in range(count)})


def _setup(name: str, hub: hub_server.Hub) -> tuple[str, str]:
    if name == "headers":
        shards = {f"model-{i:05d}-of-00004.safetensors": many(250_000, i) for i in range(4)}
        index = {"weight_map": {f"s{i}.t{j}": n for i, n in enumerate(shards) for j in range(250_000)}}
        hub.put_files("bad/headers", {**shards, "model.safetensors.index.json": json.dumps(index).encode()})
        return "hf://bad/headers", "pass"
    if name == "index":
        filler = {f"t{i:08d}": "model-00001-of-00001.safetensors" for i in range(127 * 2**20 // 48)}
        shard = safetensors({"t": b"\0" * 8})
        data = json.dumps({"weight_map": filler}).encode()
        hub.put_files("bad/index", {"model-00001-of-00001.safetensors": shard, "model.safetensors.index.json": data})
        return "hf://bad/index", "c.load()"
    if name == "gzip":
        hub.put_files("bad/gzip", {"model.safetensors": safetensors({"w": b"\1" * 4096})})
        hub.hostile["bad/gzip"] = hub_server.Hostile(bomb=2**30)
        hub_server._bomb(2**30)  # (compressed once, before the clock starts)
        return "hf://bad/gzip", "pass"
    if name in ("shards", "shards_10k"):
        count = 2_000 if name == "shards" else 10_000
        names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        files = {n: safetensors({f"layers.{i}.weight": b"\1" * 16}) for i, n in enumerate(names)}
        index = {"weight_map": {f"layers.{i}.weight": n for i, n in enumerate(names)}}
        hub.put_files(f"bad/{name}", {**files, "model.safetensors.index.json": json.dumps(index).encode()})
        return f"hf://bad/{name}", "pass"
    hub.put_files("bad/stalled", {"model.safetensors": safetensors({"w": b"\1" * 8})})
    hub.hostile["bad/stalled"] = hub_server.Hostile(stall=float("inf"))
    return "hf://bad/stalled", "pass"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=["headers", "index", "gzip", "stalled", "shards", "shards_10k"])
    parser.add_argument("--tree", default=str(ROOT))
    args = parser.parse_args()
    for name in args.only:
        with tempfile.TemporaryDirectory() as home, hub_server.serving() as (url, hub):
            path, then = _setup(name, hub)
            env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
            env.update(
                HF_ENDPOINT=url,
                HF_HOME=home,
                HF_HUB_DISABLE_XET="1",
                HF_HUB_DISABLE_PROGRESS_BARS="1",
                JAX_PLATFORMS="cpu",
                PYTHONPATH=args.tree,
            )
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    [sys.executable, "-c", _CODE.format(path=path, then=then)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=900,
                    cwd=home,
                )
            except subprocess.TimeoutExpired:
                print(f"{name}: no answer in 900 s")
                continue
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(f"{name}: crashed after {time.perf_counter() - start:.1f} s: {done.stderr[-800:]}")
                continue
            took, rss, said = json.loads(lines[-1][7:])
            print(
                f"{name}: {took:.1f} s, +{rss:.0f} MiB peak RSS, sent {hub.sent.get('', 0) / 2**20:.1f} MiB: {said}",
                flush=True,
            )


if __name__ == "__main__":
    main()
