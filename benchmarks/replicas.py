"""Bytes each process writes when several `jax.distributed` processes save a
fully replicated state (data-parallel training: every process holds every leaf).

    python benchmarks/replicas.py --processes 2 4 --total-mib 64 --chunk-mib 4

Runs, for each process count, that many processes on this machine (one CPU
device each, joined by `jax.distributed` on localhost), which save together
to a local directory: 4 large float32 leaves of `--total-mib / 4` MiB each and
16 small ones of 16 KiB, every leaf replicated over all processes. Each process
reports the bytes TensorStore wrote to files for it during the save and the
save's wall time. `--chunk-mib` sets `_format.CHUNK_BYTES` (default: the
library's, 64 MiB), the chunk size the processes' slices follow. Prints a
Markdown table (the one in docs/scaling.md came from this command).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def child(index: int, count: int, port: int, path: str, total_mib: int, chunk_mib: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    import tensorstore as ts
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import eqx_ckpt
    from eqx_ckpt import _format

    if chunk_mib:
        _format.CHUNK_BYTES = chunk_mib << 20
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    rows = (total_mib << 20) // 4 // (1024 * 4)
    values = {f"large{i}": np.full((rows, 1024), i, np.float32) for i in range(4)}
    values.update({f"small{i}": np.full((16, 256), i, np.float32) for i in range(16)})
    # Not `jax.device_put`, which compares the values across processes first (a collective).
    state = {k: jax.make_array_from_callback(v.shape, replicated, lambda i, v=v: v[i]) for k, v in values.items()}

    def written() -> int:
        metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_written")
        return sum(value.get("value", 0) for metric in metrics for value in metric["values"])

    before, start = written(), time.perf_counter()
    eqx_ckpt.tree_serialise_leaves(path, state)
    seconds = time.perf_counter() - start
    print(json.dumps({"process": index, "bytes": written() - before, "seconds": seconds}), flush=True)
    jax.distributed.shutdown()  # a barrier: process 0 runs the coordination service the others still use


def run(count: int, total_mib: int, chunk_mib: int) -> list[dict]:
    """Run `count` processes saving the state once; what each reported."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ckpt")
        args = [str(count), str(port), path, str(total_mib), str(chunk_mib)]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--child", str(i), *args], stdout=subprocess.PIPE, env=env)
            for i in range(count)
        ]
        outputs = [proc.communicate(timeout=600)[0].decode() for proc in procs]
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        index, count, port, path, total, chunk = sys.argv[2:8]
        child(int(index), int(count), int(port), path, int(total), int(chunk))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=0, help="0: the library's chunk size")
    options = parser.parse_args()
    print("| processes | MiB written by each process | largest / equal share | save (s) |")
    print("|---:|---|---:|---:|")
    for count in options.processes:
        reports = sorted(run(count, options.total_mib, options.chunk_mib), key=lambda r: r["process"])
        sizes = [r["bytes"] / 2**20 for r in reports]
        ratio = max(sizes) / (sum(sizes) / count)
        seconds = max(r["seconds"] for r in reports)
        print(f"| {count} | {', '.join(f'{s:.1f}' for s in sizes)} | {ratio:.2f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
