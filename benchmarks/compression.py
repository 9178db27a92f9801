"""Compressed checkpoints on trained state (issue 73): stored bytes, speed, memory.

`python -m benchmarks.compression [--in-size 256] [--out-size 256] [--width 2048] [--depth 4] [--steps 200]
[--batch 64] [--lr 3e-4] [--reps 5] [--compressions blosc-lz4,blosc-zstd,zstd] [--staging-mib 256]
[--mbps 200] [--parts codecs,local,s3] [--dir DIR] [--json FILE]`

Trained weights compress because their exponents are skewed; random numbers
would tell nothing. So the benchmark first trains, in this process, an
`eqx.nn.MLP` (`--in-size`, `--out-size`, `--width`, `--depth`; the defaults
about 55 MB of float32 params) with `optax.adam(--lr)` for `--steps` steps of
`--batch` samples on a synthetic regression task (the outputs of a fixed
random `tanh` MLP, inputs drawn afresh at each step). The groups measured:
the params in float32, the params cast to bfloat16, and Adam's `mu` and `nu`
(float32). Then, in one run:

1. **Codecs**: every group, in chunks of at most 8 MiB as a compressed save
   cuts them, through numcodecs directly, one thread (`numcodecs.blosc.use_threads
   = False`), each compression of `--compressions` as `_format.compressor`
   describes it (blosc bit-shuffled by the element size: bfloat16 viewed as
   `uint16`, float32 as `uint32`), and byte-shuffled blosc lz4 for reference:
   stored / raw bytes, and compress and decompress GB/s (raw bytes a second),
   medians of `--reps`, the codecs' order rotating.
2. **Local disk**: the whole state (`{"params": model, "opt_state": adam
   state}`, float32) and the params cast to bfloat16, each saved
   uncompressed (`raw`) and with each compression, each save in a fresh
   process (`work`) into a fresh directory: a warm-up (a 4 MiB tree saved
   and loaded with the same compression: imports, thread pools, codecs), then
   a blocking `tree_serialise_leaves(..., staging_bytes=--staging-mib MiB)`
   timed, with the peak RSS it adds over the process's before it (sampled
   every 10 ms, `benchmarks.gpu.PeakRSS`), `Checkpoint(path).stored_bytes /
   total_bytes`, then two loads (`tree_deserialise_leaves` into an abstract
   `like`): the first right after the save, and the second, timed as the
   *warm load* (every chunk file in the page cache: an uncompressed save
   writes its large files past it, `O_DIRECT`). Each load is compared bit
   for bit with the saved tree. `--reps` rounds, the contenders' order
   rotating in each.
3. **An object store at `--mbps` MB/s**: moto's S3 server
   on 127.0.0.1 in this process (`benchmarks.replicas.S3Server`, which counts
   the object bytes it receives and sends), behind a TCP proxy here that
   limits each direction to `--mbps` MB/s (10**6 bytes) in total over all
   connections (a token bucket per direction; `--mbps 0`: no proxy, straight
   to the server). eqx_ckpt is pointed at the proxy (a kvstore spec with
   `endpoint`), and the whole state is saved and loaded raw and with each
   compression, as above (fresh process, warm-up, save, then one load), the
   objects deleted after each. Also recorded: the object bytes the server
   received for each save and sent for each load, and the CPU seconds this
   process (the server and the proxy, Python sharing the machine's cores)
   spent on each: where the server, not the link, is the limit, it shows.

Every save and load also records the CPU seconds (user, system) of its
process, steadier than wall time on a shared machine.

`--parts` picks which of the three to measure (the training always runs).
Prints a Markdown table of each part, then the targets of issue 73 with the
figures, each "met" or "not met": stored bfloat16 params <= 0.80x and
float32 params with optimizer state <= 0.92x; locally, a compressed save
and a warm load each <= 1.3x the uncompressed one; at `--mbps` MB/s, a
compressed save and load each <= 0.9x; the peak RSS a save adds <= the
staging budget + 10%. Ratios are of medians of the same run. `--json` writes
every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from typing import Any

import numpy as np

MIB = 2**20
COMPRESSIONS = ("blosc-lz4", "blosc-zstd", "zstd")
# Byte-shuffled lz4, beside the library's bit-shuffled codecs, for reference.
BYTE_SHUFFLE = "blosc-lz4-byteshuffle"
GROUPS = ("params_fp32", "params_bf16", "adam_mu", "adam_nu")
TREES = ("state", "bf16")
# The most bytes of one compressed chunk (`_format.COMPRESSED_CHUNK_BYTES`).
CHUNK_BYTES = 8 * MIB
# The warm-up tree of each fresh process: one 4 MiB leaf and a small one.
WARM_UP_ROWS = 1024
TARGETS = {"params_bf16": 0.80, "state": 0.92, "local": 1.3, "object_store": 0.9, "memory": 1.1}


# -- The trained state ----------------------------------------------------------------------------


def build(sizes: dict[str, Any], key: Any) -> dict[str, Any]:
    """An untrained state: the MLP and its Adam state."""
    import equinox as eqx
    import optax

    model = eqx.nn.MLP(sizes["in_size"], sizes["out_size"], sizes["width"], sizes["depth"], key=key)
    opt_state = optax.adam(sizes["lr"]).init(eqx.filter(model, eqx.is_array))
    return {"params": model, "opt_state": opt_state}


def to_bf16(model: Any) -> Any:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)


def skeleton(sizes: dict[str, Any], tree: str) -> Any:
    """The abstract tree (`jax.ShapeDtypeStruct` leaves) of `state` or `bf16`."""
    import equinox as eqx
    import jax

    state = eqx.filter_eval_shape(build, sizes, jax.random.key(0))
    return state if tree == "state" else eqx.filter_eval_shape(to_bf16, state["params"])


def train(sizes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state after `steps` steps of Adam on the regression task, and how the training went."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    model_key, teacher_key, data_key = jax.random.split(jax.random.key(sizes["seed"]), 3)
    state = build(sizes, model_key)
    teacher = eqx.nn.MLP(sizes["in_size"], sizes["out_size"], 64, 1, activation=jnp.tanh, key=teacher_key)
    optimiser = optax.adam(sizes["lr"])

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, key: Any) -> tuple[Any, Any, Any]:
        x = jax.random.normal(key, (sizes["batch"], sizes["in_size"]))
        y = jax.vmap(teacher)(x)
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jnp.square(jax.vmap(m)(x) - y)))(model)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    model, opt_state = state["params"], state["opt_state"]
    losses = []
    start = time.perf_counter()
    # optax mixes Python scalars with int32 counts: JAX's standard promotion,
    # whatever the caller set (the tests make it strict).
    with jax.numpy_dtype_promotion("standard"):
        for i in range(sizes["steps"]):
            model, opt_state, loss = step(model, opt_state, jax.random.fold_in(data_key, i))
            if i == 0 or i == sizes["steps"] - 1:
                losses.append(float(loss))
    state = jax.block_until_ready({"params": model, "opt_state": opt_state})
    return state, {"seconds": time.perf_counter() - start, "first_loss": losses[0], "last_loss": losses[-1]}


def groups(state: dict[str, Any]) -> dict[str, list[np.ndarray]]:
    """The host arrays of each group (`GROUPS`)."""
    import equinox as eqx
    import jax

    def arrays(tree: Any) -> list[np.ndarray]:
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]

    adam = state["opt_state"][0]
    return {
        "params_fp32": arrays(state["params"]),
        "params_bf16": arrays(to_bf16(state["params"])),
        "adam_mu": arrays(adam.mu),
        "adam_nu": arrays(adam.nu),
    }


def nbytes(tree: Any) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


# -- 1. The codecs ---------------------------------------------------------------------------------


def codec(name: str, itemsize: int) -> Any:
    """The numcodecs codec of a compression, as `_local_write._codec` makes it."""
    import numcodecs

    from eqx_ckpt._ondisk import _format

    if name == BYTE_SHUFFLE:
        return numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, 0)
    config = _format.compressor(name, itemsize)["configuration"]
    if name == "zstd":
        return numcodecs.Zstd(level=config["level"], checksum=config["checksum"])
    return numcodecs.Blosc(config["cname"], config["clevel"], numcodecs.Blosc.BITSHUFFLE, config["blocksize"])


def chunks(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Every array's elements as unsigned integers of their size (what blosc
    shuffles by), cut in pieces of at most `CHUNK_BYTES`."""
    pieces = []
    for array in arrays:
        flat = np.ascontiguousarray(array).reshape(-1).view(f"<u{array.dtype.itemsize}")
        step = max(1, CHUNK_BYTES // array.dtype.itemsize)
        pieces += [flat[i : i + step] for i in range(0, flat.size, step)]
    return pieces


def encode_all(codec: Any, pieces: list[np.ndarray]) -> list[Any]:
    return [codec.encode(p) for p in pieces]


def decode_all(codec: Any, encoded: list[Any], outs: list[np.ndarray]) -> None:
    for data, out in zip(encoded, outs):
        codec.decode(data, out=out)


def codec_table(arrays: dict[str, list[np.ndarray]], names: list[str], reps: int) -> list[dict[str, Any]]:
    """Each group through each codec, one thread: stored / raw, compress and decompress GB/s."""
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False  # as in eqx_ckpt's writing threads: blosc's own threads off
    rows = []
    for group, group_arrays in arrays.items():
        pieces = chunks(group_arrays)
        raw = sum(p.nbytes for p in pieces)
        itemsize = pieces[0].dtype.itemsize
        codecs = {name: codec(name, itemsize) for name in names}
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
        stored: dict[str, int] = {}
        for rep in range(reps):
            for name in rotated(names, rep):
                encoded, seconds = timed(functools.partial(encode_all, codecs[name], pieces))
                outs = [np.empty_like(p) for p in pieces]
                _, back = timed(functools.partial(decode_all, codecs[name], encoded, outs))
                if rep == 0:
                    assert all(np.array_equal(p, o) for p, o in zip(pieces, outs)), f"{name} changed {group}"
                    stored[name] = sum(len(e) for e in encoded)
                times[name][0].append(seconds)
                times[name][1].append(back)
                del encoded, outs
        for name in names:
            compress, decompress = times[name]
            rows.append(
                {
                    "group": group,
                    "codec": name,
                    "raw_bytes": raw,
                    "stored_bytes": stored[name],
                    "ratio": stored[name] / raw,
                    "compress_gb_s": raw / 1e9 / statistics.median(compress),
                    "decompress_gb_s": raw / 1e9 / statistics.median(decompress),
                    "compress_s": compress,
                    "decompress_s": decompress,
                }
            )
    return rows


# -- 2. and 3. Saves and loads, each in a fresh process -------------------------------------------


def work(job: dict[str, Any]) -> dict[str, Any]:
    """One contender's save and loads, in this (fresh) process: the tree
    loaded from `job["source"]`, a warm-up, the save (time, peak RSS added),
    its stored bytes, then `job["loads"]` loads, each compared with the tree."""
    import jax
    import jax.numpy as jnp

    import eqx_ckpt

    from .gpu import PeakRSS

    like = skeleton(job["sizes"], job["tree"])
    tree = jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(job["source"], like))
    compression = job["compression"] or None
    where, warm_up = job["where"], job["warm_up"]
    rows = jnp.arange(WARM_UP_ROWS * 1024, dtype=jnp.float32).reshape(WARM_UP_ROWS, 1024) * 1e-3
    small = {"w": rows, "b": jnp.ones(16, jnp.float32)}
    eqx_ckpt.tree_serialise_leaves(warm_up, small, compression=compression)
    jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(warm_up, small))
    expected = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]
    mark(job, "start")
    gc.collect()
    with PeakRSS() as rss:
        before = os.times()
        _, seconds = timed(
            lambda: eqx_ckpt.tree_serialise_leaves(
                where, tree, compression=compression, staging_bytes=job["staging_mib"] * MIB
            )
        )
        cpu = cpu_since(before)
    mark(job, "save")
    checkpoint = eqx_ckpt.Checkpoint(where)
    result = {"save_s": seconds, "save_cpu_s": cpu, "rss_added": rss.added, "before_rss": rss.before}
    result.update(total_bytes=checkpoint.total_bytes, stored_bytes=checkpoint.stored_bytes)
    result["loads_s"], result["loads_cpu_s"] = [], []
    for _ in range(job["loads"]):
        gc.collect()
        before = os.times()
        loaded, seconds = timed(lambda: jax.block_until_ready(eqx_ckpt.tree_deserialise_leaves(where, like)))
        result["loads_cpu_s"].append(cpu_since(before))
        result["loads_s"].append(seconds)
        got = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(loaded)]
        if got != expected:
            raise AssertionError(f"{job['tree']} loaded with other values than were saved ({job['compression']})")
        del loaded, got
    mark(job, "load")
    result["loadavg"] = os.getloadavg()[0]
    return result


def cpu_since(before: os.times_result) -> list[float]:
    """The user and system CPU seconds of this process's threads since `before` (`os.times()`)."""
    now = os.times()
    return [now.user - before.user, now.system - before.system]


def mark(job: dict[str, Any], name: str) -> None:
    """Tell the S3 server (directly, not through the proxy) that a phase ended."""
    if job.get("server"):
        import urllib.request

        urllib.request.urlopen(f"{job['server']}/_phase/{job['label']}/{name}").close()


def run_one(job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """`work(job)` in a fresh Python process: its figures (or its error)."""
    code = (
        "import json, sys\n"
        "from benchmarks import compression\n"
        "print('RESULT ' + json.dumps(compression.work(json.loads(sys.argv[1]))), flush=True)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**(env or os.environ), "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, env=env, timeout=1800
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": f"exited with status {done.returncode}: {done.stderr[-3000:]}"}


def local_runs(args: argparse.Namespace, root: str, source: dict[str, str]) -> list[dict[str, Any]]:
    """Every tree saved raw and with each compression, `--reps` rounds, the order rotating."""
    contenders = ["", *args.compressions]
    rows = []
    for rep in range(args.reps):
        for tree in TREES:
            for compression in rotated(contenders, rep):
                where = os.path.join(root, f"{tree}-{compression or 'raw'}-{rep}")
                job = job_of(args, tree, compression, source[tree], where, os.path.join(root, "warm-up"), loads=2)
                os.sync()  # what earlier saves left unwritten is written now, not during this one
                row = {"tree": tree, "compression": compression or "raw", "rep": rep, **run_one(job)}
                shutil.rmtree(where, ignore_errors=True)
                shutil.rmtree(os.path.join(root, "warm-up"), ignore_errors=True)
                rows.append(row)
                show(row)
    return rows


def job_of(
    args: argparse.Namespace, tree: str, compression: str, source: str, where: Any, warm_up: Any, loads: int
) -> dict[str, Any]:
    return {
        "sizes": sizes_of(args),
        "tree": tree,
        "compression": compression,
        "source": source,
        "where": where,
        "warm_up": warm_up,
        "loads": loads,
        "staging_mib": args.staging_mib,
    }


def show(row: dict[str, Any]) -> None:
    where = row.get("store", "local")
    name = f"  {where:5s} {row['tree']:5s} {row['compression']:10s} rep {row['rep']}"
    if "error" in row:
        print(f"{name}: FAILED: {row['error']}", flush=True)
        return
    loads = ", ".join(f"{s:.3f}" for s in row["loads_s"])
    cpu = "save CPU {:.2f} + {:.2f} s".format(*row["save_cpu_s"])
    if "server_cpu_s" in row:
        cpu += ", server CPU {save:.2f} s (save), {load:.2f} s (load)".format(**row["server_cpu_s"])
    print(
        f"{name}: save {row['save_s']:.3f} s, loads {loads} s, +{row['rss_added'] / MIB:.0f} MiB RSS, {cpu}, "
        f"load average {row['loadavg']:.1f}",
        flush=True,
    )


# -- The object store behind a link of `--mbps` MB/s -----------------------------------------------


class TokenBucket:
    """At most `rate` bytes a second through `take`, over all the threads that
    call it (none when `rate` is 0). A taker runs up a debt and sleeps until
    the bucket would have refilled it; at most `burst` bytes of credit build
    up while the link is idle."""

    def __init__(self, rate: float, burst: int = 256 * 1024) -> None:
        self.rate, self.burst = rate, burst
        self.available = float(burst)
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.available = min(self.burst, self.available + (now - self.last) * self.rate) - n
            self.last = now
            wait = -self.available / self.rate
        if wait > 0:
            time.sleep(wait)


class Link:
    """A TCP proxy on 127.0.0.1 in front of `upstream` (host, port), each
    direction limited to `mbps` MB/s in total over all its connections (0: no
    limit); `sent_up` and `sent_down` count the bytes it forwarded each way.
    A connection's two sockets are closed once both directions have ended."""

    def __init__(self, upstream: tuple[str, int], mbps: float) -> None:
        self.upstream = upstream
        self.up, self.down = TokenBucket(mbps * 1e6), TokenBucket(mbps * 1e6)
        self.sent_up = self.sent_down = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: dict[tuple[socket.socket, socket.socket], int] = {}  # each connection's pumps still running
        self.thread = threading.Thread(target=self._accept, name="link-accept", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            pair = (client, server)
            for s in pair:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.open[pair] = 2
            threading.Thread(target=self._pump, args=(pair, client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, server, client, False), daemon=True).start()

    def _pump(
        self, pair: tuple[socket.socket, socket.socket], source: socket.socket, sink: socket.socket, up: bool
    ) -> None:
        bucket = self.up if up else self.down
        try:
            while True:
                data = source.recv(64 * 1024)
                if not data:
                    break
                bucket.take(len(data))
                sink.sendall(data)
                with self.lock:
                    if up:
                        self.sent_up += len(data)
                    else:
                        self.sent_down += len(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with self.lock:
            self.open[pair] -= 1
            done = not self.open[pair]
            if done:
                del self.open[pair]
        if done:
            for s in pair:
                s.close()

    def close(self) -> None:
        """Stop accepting, and end the connections still open."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone does not)
        self.listener.close()
        self.thread.join()
        with self.lock:
            pairs = list(self.open)
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def object_store(mbps: float) -> Iterator[tuple[Any, Link]]:
    """moto's S3 server (`replicas.S3Server`, with its byte counters) behind a
    `Link`. It also records, at each phase a child marks, the CPU seconds this
    process (the server and the link) has used so far (`cpu`)."""
    from .replicas import S3Server

    class Server(S3Server):
        def __init__(self) -> None:
            self.cpu: dict[str, float] = {}
            super().__init__()

        def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
            path = environ.get("PATH_INFO", "")
            if path.startswith("/_phase/"):
                times = os.times()
                self.cpu[path.removeprefix("/_phase/")] = times.user + times.system
            return super().__call__(environ, start_response)

    server = Server()
    host, port = server.server.server_address[:2]
    link = Link((str(host), int(port)), mbps)
    try:
        yield server, link
    finally:
        link.close()
        server.stop()


def s3_spec(endpoint: str, bucket: str, path: str) -> dict[str, Any]:
    return {
        "driver": "s3",
        "bucket": bucket,
        "path": path,
        "endpoint": endpoint,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


def delete_objects(spec: dict[str, Any]) -> None:
    """Delete every object under `spec` (moto holds them in this process's memory)."""
    import tensorstore as ts

    ts.KvStore.open(spec).result().delete_range(ts.KvStore.KeyRange()).result()


@contextlib.contextmanager
def aws_environment() -> Iterator[dict[str, str]]:
    """The dummy keys `replicas.s3_environment` gives, in this process too (its
    deletions sign their requests like the children's saves), for a `with` block."""
    from .replicas import s3_environment

    saved = dict(os.environ)
    env = s3_environment(saved)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield env
    finally:
        os.environ.clear()
        os.environ.update(saved)


def s3_runs(args: argparse.Namespace, source: dict[str, str]) -> list[dict[str, Any]]:
    """The whole state saved and loaded through the link, raw and with each compression."""
    from .replicas import BUCKET

    contenders = ["", *args.compressions]
    rows = []
    with aws_environment() as env, object_store(args.mbps) as (server, link):
        for rep in range(args.reps):
            for compression in rotated(contenders, rep):
                label = f"{compression or 'raw'}-{rep}"
                endpoint = link.endpoint if args.mbps else server.endpoint  # 0: straight to the server
                where = s3_spec(endpoint, BUCKET, f"{label}/ckpt/")
                warm_up = s3_spec(endpoint, BUCKET, f"{label}/warm-up/")
                job = job_of(args, "state", compression, source["state"], where, warm_up, loads=1)
                job.update(server=server.endpoint, label=label)
                up, down = link.sent_up, link.sent_down
                row = {"store": "s3", "tree": "state", "compression": compression or "raw", "rep": rep}
                row.update(run_one(job, env))
                if "error" not in row:
                    row["received_bytes"], _ = server.between(f"{label}/start", f"{label}/save")
                    _, row["sent_bytes"] = server.between(f"{label}/save", f"{label}/load")
                    cpu = [server.cpu[f"{label}/{phase}"] for phase in ("start", "save", "load")]
                    row["server_cpu_s"] = {"save": cpu[1] - cpu[0], "load": cpu[2] - cpu[1]}
                row.update(link_up_bytes=link.sent_up - up, link_down_bytes=link.sent_down - down)
                for spec in (where, warm_up):
                    delete_objects({**spec, "endpoint": server.endpoint})
                rows.append(row)
                show(row)
    return rows


# -- Figures ---------------------------------------------------------------------------------------


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = run()
    return value, time.perf_counter() - start


def rotated(names: list[str], rep: int) -> list[str]:
    """The contenders in the order round `rep` runs them: each round starts one
    further along, so that none always runs first (`benchmarks.run.rotated`)."""
    shift = rep % len(names) if names else 0
    return names[shift:] + names[:shift]


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (tree, compression): the median save and load (the last of each
    process's loads: the warm one locally), the worst peak RSS added, the stored ratio."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key in dict.fromkeys((r["tree"], r["compression"]) for r in rows):
        ok = [r for r in rows if (r["tree"], r["compression"]) == key and "error" not in r]
        if not ok:
            out[key] = {"failed": True}
            continue
        figures = {
            "runs": len(ok),
            "save_s": statistics.median(r["save_s"] for r in ok),
            "load_s": statistics.median(r["loads_s"][-1] for r in ok),
            "worst_save_s": max(r["save_s"] for r in ok),
            "worst_load_s": max(r["loads_s"][-1] for r in ok),
            # CPU seconds (user, system), steadier than wall time on a shared machine
            "save_cpu_s": [statistics.median(r["save_cpu_s"][i] for r in ok) for i in (0, 1)],
            "load_cpu_s": [statistics.median(r["loads_cpu_s"][-1][i] for r in ok) for i in (0, 1)],
            "rss_added": max(r["rss_added"] for r in ok),
            "total_bytes": ok[0]["total_bytes"],
        }
        figures["stored_bytes"] = stored = ok[0]["stored_bytes"]
        figures["ratio"] = stored / ok[0]["total_bytes"] if stored is not None else None
        if "received_bytes" in ok[0]:  # on the object store: what went up for a save, and down for a load
            figures["received_bytes"] = statistics.median(r["received_bytes"] for r in ok)
            figures["sent_bytes"] = statistics.median(r["sent_bytes"] for r in ok)
        out[key] = figures
    return out


def link_name(mbps: float) -> str:
    return f"S3 at {mbps:g} MB/s" if mbps else "S3, no limit (no proxy)"


def verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(
    args: argparse.Namespace, codecs: list[dict[str, Any]], local: dict[tuple[str, str], Any] | None, s3: dict | None
) -> list[dict[str, Any]]:
    """Issue 73's targets: one row per target, with each compression's figure and whether it is met."""
    rows: list[dict[str, Any]] = []
    budget = args.staging_mib * MIB

    def add(target: str, figures: dict[str, tuple[str, bool | None]]) -> None:
        rows.append({"target": target, "figures": {c: {"figure": f, "met": ok} for c, (f, ok) in figures.items()}})

    ratios = {(r["group"], r["codec"]): r["ratio"] for r in codecs}
    for tree, group, what in (("bf16", "params_bf16", "bf16 params"), ("state", "state", "fp32 params + Adam state")):
        bound, figures = TARGETS[group], {}
        for c in args.compressions:
            m = (local or {}).get((tree, c), {})
            parts = ["params_bf16"] if group == "params_bf16" else ["params_fp32", "adam_mu", "adam_nu"]
            if m.get("ratio") is not None:
                figures[c] = (f"{m['ratio']:.3f}x", m["ratio"] <= bound)
            elif all((part, c) in ratios for part in parts):  # without the saves: the codec's, by the bytes
                size = {r["group"]: r["raw_bytes"] for r in codecs}
                ratio = sum(ratios[part, c] * size[part] for part in parts) / sum(size[part] for part in parts)
                figures[c] = (f"{ratio:.3f}x (codec)", ratio <= bound)
            else:
                figures[c] = ("not measured", None)
        add(f"stored {what} <= {bound:.2f}x (`stored_bytes / total_bytes`)", figures)
        if group == "state" and ratios:  # its parts, from the codec table
            for part in ("params_fp32", "adam_mu", "adam_nu"):
                figures = {c: (f"{ratios[part, c]:.3f}x", ratios[part, c] <= bound) for c in args.compressions}
                add(f"  {part} alone, codec <= {bound:.2f}x", figures)
    for where, medians_of, bound, load in (
        ("local disk", local, TARGETS["local"], "warm load"),
        (link_name(args.mbps), s3, TARGETS["object_store"], "load"),
    ):
        if medians_of is None:
            continue
        for op, key in (("save", "save_s"), (load, "load_s")):
            for tree in TREES:
                raw = medians_of.get((tree, "raw"))
                if raw is None:
                    continue
                figures = {}
                for c in args.compressions:
                    m = medians_of.get((tree, c))
                    if m is None or m.get("failed") or raw.get("failed"):
                        figures[c] = ("failed", None)
                        continue
                    ratio = m[key] / raw[key]
                    figures[c] = (f"{ratio:.2f}x ({m[key]:.3f} / {raw[key]:.3f} s)", ratio <= bound)
                what = "state" if tree == "state" else "bf16 params"
                add(f"{where}: {op} of the {what} <= {bound}x raw", figures)
    for where, medians_of in (("local disk", local), ("S3", s3)):
        for tree in TREES:
            figures = {}
            for c in ["raw", *args.compressions]:
                m = (medians_of or {}).get((tree, c))
                if m is not None and not m.get("failed"):
                    added = m["rss_added"]
                    figures[c] = (f"{added / MIB:.0f} MiB", added <= TARGETS["memory"] * budget)
            if figures:
                what = "state" if tree == "state" else "bf16 params"
                add(f"{where}: peak RSS a save of the {what} adds <= {args.staging_mib} MiB + 10%", figures)
    return rows


# -- Tables ----------------------------------------------------------------------------------------


def print_tables(result: dict[str, Any]) -> None:
    train = result["train"]
    print(
        f"\ntrained {result['sizes']['steps']} steps in {train['seconds']:.1f} s, "
        f"loss {train['first_loss']:.4f} -> {train['last_loss']:.4f}; "
        f"state {result['state_bytes'] / 1e6:.1f} MB, bf16 params {result['bf16_bytes'] / 1e6:.1f} MB\n"
    )
    print("| group | codec | raw MB | stored / raw | compress GB/s | decompress GB/s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in result["codecs"]:
        print(
            f"| {r['group']} | {r['codec']} | {r['raw_bytes'] / 1e6:.1f} | {r['ratio']:.3f} | "
            f"{r['compress_gb_s']:.2f} | {r['decompress_gb_s']:.2f} |"
        )
    for name, title, load in (("local", "local disk", "warm load"), ("s3", link_name(result["mbps"]), "load")):
        if f"{name}_medians" not in result:
            continue
        s3 = name == "s3"
        print(f"\n{title}, medians of {result['reps']}:\n")
        sizes = "MB up (save) | MB down (load)" if s3 else "stored / raw"
        print(
            f"| tree | compression | save (s) | vs raw | save CPU, user + sys (s) | {load} (s) | vs raw "
            f"| {load} CPU, user + sys (s) | {sizes} | peak RSS added by the save |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (1 + s3))
        figures = result[f"{name}_medians"]
        for (tree, c), m in figures.items():
            if m.get("failed"):
                print(f"| {tree} | {c} | failed |" + " |" * (7 + s3))
                continue
            raw = figures.get((tree, "raw"), {})
            vs = {k: f"{m[k] / raw[k]:.2f}x" if raw.get(k) else "–" for k in ("save_s", "load_s")}
            cpu = {k: "{:.2f} + {:.2f}".format(*m[k]) for k in ("save_cpu_s", "load_cpu_s")}
            if s3:
                size = f"{m['received_bytes'] / 1e6:.1f} | {m['sent_bytes'] / 1e6:.1f}"
            else:
                size = f"{m['ratio']:.3f}" if m["ratio"] is not None else "–"
            print(
                f"| {tree} | {c} | {m['save_s']:.3f} | {vs['save_s']} | {cpu['save_cpu_s']} | {m['load_s']:.3f} "
                f"| {vs['load_s']} | {cpu['load_cpu_s']} | {size} | {m['rss_added'] / MIB:.0f} MiB |"
            )
    present = {c for t in result["targets"] for c in t["figures"]}
    names = [c for c in ["raw", *result["compressions"]] if c in present]
    print("\n| target | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for t in result["targets"]:
        cells = []
        for c in names:
            f = t["figures"].get(c)
            cells.append("" if f is None else f["figure"] + ("" if f["met"] is None else f", {verdict(f['met'])}"))
        print(f"| {t['target']} | " + " | ".join(cells) + " |")


def sizes_of(args: argparse.Namespace) -> dict[str, Any]:
    names = ("in_size", "out_size", "width", "depth", "steps", "batch", "lr", "seed")
    return {name: getattr(args, name) for name in names}


def jsonable(figures: dict[tuple[str, str], Any]) -> list[dict[str, Any]]:
    return [{"tree": tree, "compression": c, **m} for (tree, c), m in figures.items()]


PARTS = ("codecs", "local", "s3")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-size", dest="in_size", type=int, default=256)
    parser.add_argument("--out-size", dest="out_size", type=int, default=256)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--steps", type=int, default=200, help="Adam steps of training")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5, help="rounds of every measurement")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS), help="comma-separated")
    parser.add_argument("--staging-mib", dest="staging_mib", type=int, default=256, help="a save's staging_bytes")
    parser.add_argument("--mbps", type=float, default=200.0, help="MB/s each way to the object store (0: no limit)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: what to measure")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    args.compressions = [c for c in args.compressions.split(",") if c]
    unknown = set(args.compressions) - set(COMPRESSIONS)
    if unknown:
        parser.error(f"unknown compressions {sorted(unknown)}; choose from {list(COMPRESSIONS)}")
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {list(PARTS)}")
    import jax

    import eqx_ckpt

    started = time.perf_counter()
    sizes = sizes_of(args)
    result: dict[str, Any] = {"sizes": sizes, "reps": args.reps, "staging_mib": args.staging_mib, "mbps": args.mbps}
    result["compressions"], result["parts"] = args.compressions, parts
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    result["versions"] = {name: version(name) for name in ("jax", "tensorstore", "numcodecs", "equinox", "optax")}
    state, result["train"] = train(sizes)
    print(
        f"trained: {result['train']['seconds']:.1f} s, loss {result['train']['first_loss']:.4f} -> "
        f"{result['train']['last_loss']:.4f}",
        flush=True,
    )
    bf16 = jax.block_until_ready(to_bf16(state["params"]))
    result["state_bytes"], result["bf16_bytes"] = nbytes(state), nbytes(bf16)
    codecs = [*args.compressions, BYTE_SHUFFLE]
    result["codecs"] = codec_table(groups(state), codecs, args.reps) if "codecs" in parts else []
    local = s3 = None
    root = tempfile.mkdtemp(prefix="eqx_ckpt_compression_", dir=args.dir)
    try:
        source = {"state": os.path.join(root, "source-state"), "bf16": os.path.join(root, "source-bf16")}
        eqx_ckpt.tree_serialise_leaves(source["state"], state)
        eqx_ckpt.tree_serialise_leaves(source["bf16"], bf16)
        del state, bf16
        gc.collect()
        if "local" in parts:
            result["local"] = local_runs(args, root, source)
            result["local_medians"] = local = medians(result["local"])
        if "s3" in parts:
            result["s3"] = s3_runs(args, source)
            result["s3_medians"] = s3 = medians(result["s3"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["targets"] = targets(args, result["codecs"], local, s3)
    result["machine"]["loadavg_end"] = os.getloadavg()[0]
    result["run_seconds"] = time.perf_counter() - started
    print_tables(result)
    out = {k: jsonable(v) if k.endswith("_medians") else v for k, v in result.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
