"""Bytes each process writes when several `jax.distributed` processes save a
fully replicated state (data-parallel training: every process holds every
leaf), and bytes read from storage when they restore it, with and without
sharing the reads (`read_once`).

    python benchmarks/replicas.py --processes 2 4 --total-mib 64 --chunk-mib 4
    python benchmarks/replicas.py --processes 2 4 8 --total-mib 512 --s3

Runs, for each process count, that many processes on this machine (one CPU
device each, joined by `jax.distributed` on localhost), which save together
to a local directory (or, with `--s3`, to an S3-compatible server started on
localhost: moto's): 4 large float32 leaves of `--total-mib / 4` MiB each and
16 small ones of 16 KiB, every leaf replicated over all processes. Then every
process restores the state once for each `--read-once` value (default: false,
then true), and compares each shard it holds with the saved values (a CRC-32
of each shard's bytes).

Each process reports the bytes TensorStore wrote to storage for it during the
save, the bytes it read from storage during each restore (TensorStore's
counters, `/tensorstore/kvstore/{file,s3}/bytes_{written,read}`) and the
wall time of each; a phase starts after a barrier, so the time of a phase is
the slowest process's. With `--s3` the server also counts the bytes of the
objects it received (PUT) and sent (GET) in each phase. `--chunk-mib` sets
`_format.CHUNK_BYTES` (default: the library's, 64 MiB), the chunk size the
processes' slices follow.

`--baseline DIR` also runs, in the same invocation and before each process
count's run of this code, the eqx_ckpt source tree in `DIR` (e.g. a git
worktree of an older commit): its save, and its restore without a
`read_once` argument when its `tree_deserialise_leaves` has none.

Prints two Markdown tables, saves and restores (those in docs/scaling.md came
from this command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

BUCKET = "eqx-ckpt-bench"
READ_ONCE = {"false": False, "true": True, "none": None}
FILE_WRITTEN, S3_WRITTEN = "/tensorstore/kvstore/file/bytes_written", "/tensorstore/kvstore/s3/bytes_written"
FILE_READ, S3_READ = "/tensorstore/kvstore/file/bytes_read", "/tensorstore/kvstore/s3/bytes_read"


def leaf_values(total_mib: int) -> dict[str, Any]:
    """The state's values: distinct in every leaf, and along each leaf (a slice
    put in the wrong place does not compare equal)."""
    import numpy as np

    def leaf(shape: tuple[int, int], seed: int) -> np.ndarray:
        count = shape[0] * shape[1]
        # Integers under 2**24, exact in float32; a period that is no power of two.
        return ((np.arange(count, dtype=np.uint32) % 16777191).astype(np.float32) + np.float32(seed)).reshape(shape)

    rows = (total_mib << 20) // 4 // (1024 * 4)
    values = {f"large{i}": leaf((rows, 1024), i) for i in range(4)}
    values.update({f"small{i}": leaf((16, 256), 4 + i) for i in range(16)})
    return values


def child(index: int, job: dict) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_platforms", "cpu")
    import gc
    import inspect
    import time
    import zlib

    import numpy as np
    import tensorstore as ts
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import eqx_ckpt
    from eqx_ckpt._ondisk import _format

    if job["chunk_mib"]:
        _format.CHUNK_BYTES = job["chunk_mib"] << 20
    where, count = job["where"], job["count"]
    jax.distributed.initialize(f"127.0.0.1:{job['port']}", num_processes=count, process_id=index)
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    values = leaf_values(job["total_mib"])

    def region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
        return tuple(s.indices(n)[:2] for s, n in zip(index, shape))

    # Not `jax.device_put`, which compares the values across processes first (a collective).
    state = {k: jax.make_array_from_callback(v.shape, replicated, lambda i, v=v: v[i]) for k, v in values.items()}
    expected = {
        k: {region(s.index, v.shape): zlib.crc32(np.ascontiguousarray(v[s.index])) for s in state[k].addressable_shards}
        for k, v in values.items()
    }
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in values.items()}
    del values

    def counted(*names: str) -> int:
        metrics = [m for name in names for m in ts.experimental_collect_matching_metrics(name)]
        return sum(value.get("value", 0) for metric in metrics for value in metric["values"])

    def phase(name: str, run: Any) -> tuple[Any, float, int, int]:
        """Run `run()` after a barrier: its result, wall time, and the bytes
        this process wrote and read; then the S3 server is told the phase ended."""
        multihost_utils.sync_global_devices(f"before {name}")
        written, read, start = counted(FILE_WRITTEN, S3_WRITTEN), counted(FILE_READ, S3_READ), time.perf_counter()
        result = jax.block_until_ready(run())
        seconds = time.perf_counter() - start
        written, read = counted(FILE_WRITTEN, S3_WRITTEN) - written, counted(FILE_READ, S3_READ) - read
        multihost_utils.sync_global_devices(f"after {name}")
        mark(name)
        return result, seconds, written, read

    def mark(name: str) -> None:
        if index == 0 and isinstance(where, dict):  # nothing else reaches the server until the next barrier
            urllib.request.urlopen(f"{where['endpoint']}/_phase/{job['label']}/{count}/{name}").close()

    mark("start")  # before the first barrier
    report: dict[str, Any] = {"process": index}
    _, report["save"], report["written"], _ = phase(
        "save", lambda tree=state: eqx_ckpt.tree_serialise_leaves(where, tree)
    )
    del state
    gc.collect()
    has_read_once = "read_once" in inspect.signature(eqx_ckpt.tree_deserialise_leaves).parameters
    report["restores"] = []
    for mode in job["read_once"] if has_read_once else ["-"]:
        kwargs = {} if mode == "-" else {"read_once": READ_ONCE[mode]}
        loaded, seconds, _, read = phase(
            f"restore-{mode}", lambda kwargs=kwargs: eqx_ckpt.tree_deserialise_leaves(where, like, **kwargs)
        )
        for k, sums in expected.items():
            got = {
                region(s.index, loaded[k].shape): zlib.crc32(np.ascontiguousarray(s.data))
                for s in loaded[k].addressable_shards
            }
            assert loaded[k].dtype == np.float32 and got == sums, f"process {index}: {k} restored with other values"
        report["restores"].append({"read_once": mode, "read": read, "seconds": seconds})
        del loaded
        gc.collect()
    if index == 0:
        checkpoint = eqx_ckpt.Checkpoint(where)
        report["stored"] = sum(checkpoint.record(path).nbytes for path in checkpoint)
    print(json.dumps(report), flush=True)
    jax.distributed.shutdown()  # a barrier: process 0 runs the coordination service the others still use


class S3Server:
    """moto's S3 server on 127.0.0.1, behind a counter of the object bytes it
    receives (PUT bodies) and sends (GET bodies). A GET of `/_phase/<name>`
    (process 0, between two barriers) records the counts so far under
    `<name>`."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.app = DomainDispatcherApplication(create_backend_app)
        self.received = self.sent = 0
        self.phases: dict[str, tuple[int, int]] = {}
        self.lock = threading.Lock()
        self.server = make_server("127.0.0.1", 0, self, threaded=True)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        # moto takes unsigned requests: the bucket needs no S3 client.
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")).close()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path.startswith("/_phase/"):
            with self.lock:
                self.phases[path.removeprefix("/_phase/")] = (self.received, self.sent)
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if method == "PUT":
            with self.lock:
                self.received += int(environ.get("CONTENT_LENGTH") or 0)
        body = self.app(environ, start_response)
        return self._sending(body) if method == "GET" else body

    def _sending(self, body: Any) -> Iterator[bytes]:
        try:
            for part in body:
                with self.lock:
                    self.sent += len(part)
                yield part
        finally:
            if hasattr(body, "close"):
                body.close()

    def spec(self, path: str) -> dict[str, Any]:
        return {
            "driver": "s3",
            "bucket": BUCKET,
            "path": path,
            "endpoint": self.endpoint,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }

    def between(self, start: str, end: str) -> tuple[int, int]:
        """Bytes received and sent between two recorded phases."""
        (r0, s0), (r1, s1) = self.phases[start], self.phases[end]
        return r1 - r0, s1 - s0

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join()
        self.server.server_close()


def s3_environment(env: dict[str, str]) -> dict[str, str]:
    """Dummy keys for the children: TensorStore signs every request (moto does
    not check signatures), and with none it would look for EC2's metadata service."""
    env = {**env, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(name, None)
    return env


def run(count: int, options: argparse.Namespace, s3: S3Server | None, code: str, source: str | None) -> list[dict]:
    """Run `count` processes saving the state once and restoring it; what each reported."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if source:
        env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [env.get("PYTHONPATH")])])
    if s3:
        env = s3_environment(env)
    with contextlib.ExitStack() as stack:
        if s3:
            where: Any = s3.spec(f"{code}-{count}/ckpt/")
        else:
            where = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "ckpt")
        job = {"label": code, "count": count, "port": port, "where": where, "total_mib": options.total_mib}
        job.update(chunk_mib=options.chunk_mib, read_once=options.read_once)
        argv = [sys.executable, os.path.abspath(__file__), "--child"]
        procs = [
            subprocess.Popen([*argv, str(i), json.dumps(job)], stdout=subprocess.PIPE, env=env) for i in range(count)
        ]
        outputs = [proc.communicate(timeout=options.timeout)[0].decode() for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"{code}, {count} processes: a process failed: {[p.returncode for p in procs]}")
    return sorted((json.loads(out.strip().splitlines()[-1]) for out in outputs), key=lambda r: r["process"])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=0, help="0: the library's chunk size")
    parser.add_argument("--read-once", nargs="+", choices=list(READ_ONCE), default=["false", "true"])
    parser.add_argument("--s3", action="store_true", help="save to a local S3 server (moto) instead of a directory")
    parser.add_argument("--baseline", metavar="DIR", help="also run the eqx_ckpt source tree in DIR")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run of processes may take")
    options = parser.parse_args()
    codes = [("baseline", os.path.abspath(options.baseline))] if options.baseline else []
    codes.append(("this", None))
    with contextlib.ExitStack() as stack:
        s3 = S3Server() if options.s3 else None
        if s3:
            stack.callback(s3.stop)
        s3_heads = (" S3 server received (MiB) |", " S3 server sent (MiB) |") if s3 else ("", "")
        results = {
            (code, count): run(count, options, s3, code, source)
            for count in options.processes
            for code, source in codes
        }
    print("| code | processes | MiB written by each process | largest / equal share | save (s) |" + s3_heads[0])
    print("|---|---:|---|---:|---:|" + "---:|" * bool(s3))
    for (code, count), reports in results.items():
        sizes = [r["written"] for r in reports]
        row = [code, str(count), ", ".join(mib(n) for n in sizes), f"{max(sizes) / (sum(sizes) / count):.2f}"]
        row.append(f"{max(r['save'] for r in reports):.2f}")
        if s3:
            row.append(mib(s3.between(f"{code}/{count}/start", f"{code}/{count}/save")[0]))
        print("| " + " | ".join(row) + " |")
    print()
    print(
        "| code | processes | read_once | MiB read, all processes | / checkpoint | largest process | restore (s) |"
        + s3_heads[1]
    )
    print("|---|---:|---|---:|---:|---:|---:|" + "---:|" * bool(s3))
    for (code, count), reports in results.items():
        stored = next(r["stored"] for r in results["this", count] if "stored" in r)
        before = "save"
        for i, restore in enumerate(reports[0]["restores"]):
            read = [r["restores"][i]["read"] for r in reports]
            row = [code, str(count), restore["read_once"], mib(sum(read)), f"{sum(read) / stored:.3f}", mib(max(read))]
            row.append(f"{max(r['restores'][i]['seconds'] for r in reports):.2f}")
            if s3:
                now = f"restore-{restore['read_once']}"
                row.append(mib(s3.between(f"{code}/{count}/{before}", f"{code}/{count}/{now}")[1]))
                before = now
            print("| " + " | ".join(row) + " |")
    print()
    print(f"checkpoint: {mib(stored)} MiB of array bytes (the leaves' stored bytes)")


if __name__ == "__main__":
    main()
