"""One large leaf read three ways, each ending in a JAX array on the CPU:

- `direct`: the local-disk reader, `eqx_ckpt._store._chunk_files.chunk_files(loc).start_read` (preadv into one
  aligned buffer, crc32c);
- `ts`: TensorStore's read of the same zarr array (what a load does today);
- `raw`: the same bytes as one file, read by parallel `pread` into an aligned
  buffer, as the `raw` contender does: no checksum, no chunk files.

Warm: from the page cache. Cold: the files dropped from it first
(`posix_fadvise(DONTNEED)`, so only these files), then read from the disk.

    .venv/bin/python -m benchmarks.direct_read [GiB] [repeats]
"""

from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

import eqx_ckpt
from eqx_ckpt._load._load_plan import LoadOptions
from eqx_ckpt._sources._opening import open_source
from eqx_ckpt._store import _chunk_files, _storage

from . import contenders, workload

RESULTS = pathlib.Path(__file__).parent / "results"


def _drop_from_cache(folder: pathlib.Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw(path: pathlib.Path, shape: tuple[int, ...]) -> np.ndarray:
    host = workload.aligned_empty(shape, np.float32)
    view = host.reshape(-1).data.cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(contenders.READ_THREADS) as pool:
            starts = range(0, len(view), contenders.PREAD_PIECE)
            list(pool.map(lambda s: contenders._pread_all(fd, view[s : s + contenders.PREAD_PIECE], s), starts))
    finally:
        os.close(fd)
    return host


def _direct(data: Any, record: Any) -> np.ndarray:
    read = _chunk_files.chunk_files(data).start_read(record)
    if read is None:
        raise SystemExit("the local-disk reader declined this leaf")
    return read()


def main(gib: float = 1.0, repeats: int = 5) -> None:
    rows = int(gib * 2**30) // (4 * 4096)
    x = np.random.default_rng(0).standard_normal((rows, 4096), dtype=np.float32)
    RESULTS.mkdir(exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(dir=RESULTS))
    try:
        eqx_ckpt.tree_serialise_leaves(base / "ckpt", {"w": x})
        contenders.Raw().save(str(base / "raw.bin"), {"w": x})
        data, record = open_source(base / "ckpt", LoadOptions()).data, eqx_ckpt.Checkpoint(base / "ckpt").record("w")
        ways: dict[str, Callable[[], np.ndarray | None]] = {
            "direct": lambda: _direct(data, record),
            "ts": lambda: _storage.open_array(data, record).result().read().result(),
            "raw": lambda: _raw(base / "raw.bin", x.shape),
        }
        print(f"{x.nbytes / 2**30:.2f} GiB, chunks {list(record.chunks)}, {repeats} runs, load {os.getloadavg()}")
        for cold in (False, True):
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(repeats):
                for name, read in ways.items():
                    if cold:
                        _drop_from_cache(base)
                    start = time.perf_counter()
                    loaded = jax.block_until_ready(jax.device_put(read()))
                    times[name].append(time.perf_counter() - start)
                    if not np.array_equal(np.asarray(loaded), x):
                        raise SystemExit(f"{name} read different values")
                    del loaded
            for name, spent in times.items():
                median, cache = statistics.median(spent), "cold" if cold else "warm"
                print(
                    f"{cache} {name:7s} median {median:.3f} s ({x.nbytes / median / 1e9:.2f} GB/s), "
                    f"runs {[round(t, 3) for t in spent]}"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
