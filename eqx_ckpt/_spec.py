"""Where a checkpoint lives, and the TensorStore spec dicts for its arrays.

Only this module and `_io.py` import `tensorstore`. Specs stay plain dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from ._errors import CheckpointTypeError

# One context for every open: it is what makes `memory://` stores persist between
# calls, and what bounds file I/O concurrency for the whole process.
#
# Its `http_request_retries` make a plain `http://` server that cannot be reached
# an error within about 5 s: TensorStore's default (32 attempts, backing off from
# 1 s to 32 s) retried a refused connection for a quarter of an hour, and a load
# seemed to hang. Four attempts over about 4 s still ride out a server's brief
# hiccup (a 503, a dropped connection). Only the `http` driver reads this
# resource: `s3://` and `gs://` keep their own, `s3_request_retries` and
# `gcs_request_retries`, at TensorStore's defaults, where retrying for minutes
# is what a busy object store needs. A kvstore spec dict may carry its own
# `"http_request_retries"`, which wins over this one.
CONTEXT = ts.Context({"http_request_retries": {"max_retries": 4, "initial_delay": "0.25s", "max_delay": "2s"}})
# For the arrays of a save to a local disk: no fsync per file (thousands of them
# cost seconds each batch); the save flushes once before it commits (`_io.flush`).
# Only for the `file` driver: a `memory://` store lives in its context.
UNSYNCED = ts.Context({"file_io_sync": False})
# For packs read one leaf at a time: their decoded chunks are kept, so that the
# leaves of one chunk read it once. (A child of `CONTEXT`: same `memory://` stores.)
CACHED = ts.Context({"cache_pool": {"total_bytes_limit": 64 * 2**20}}, parent=CONTEXT)

# Data types the zarr3 driver stores natively. Others (uint2, uint4, float8_e4m3)
# are stored as the raw bytes, viewed as an unsigned integer of the same size.
NATIVE_DTYPES = frozenset(
    "bool int2 int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "float16 bfloat16 float32 float64 complex64 complex128 float8_e3m4 "
    "float8_e4m3fn float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn".split()
)

CHUNK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint directory: a TensorStore kvstore spec whose path ends in `/`.

    **Attributes:**

    - `kvstore`: the kvstore spec dict.
    - `display`: the path as the user wrote it, for messages.
    - `local`: the absolute local directory, when it is one.
    """

    kvstore: dict[str, Any]
    display: str
    local: str | None

    def key(self, relative: str) -> str:
        return self.kvstore.get("path", "") + relative

    def child(self, relative: str) -> dict[str, Any]:
        """The kvstore spec of a directory below this one ("" is this one)."""
        sub = relative.strip("/")
        return {**self.kvstore, "path": self.key(sub + "/" if sub else "")}

    def joined(self, relative: str) -> Location:
        """The location of a sub-directory (used by the manager for its steps)."""
        local = None if self.local is None else os.path.join(self.local, relative)
        display = self.display.rstrip("/") + "/" + relative
        return Location(self.child(relative), display, local)


def location(path: Any) -> Location:
    """Turn what the user passed as `path` into a `Location`.

    Accepts a local path (`str` or `os.PathLike`), a TensorStore kvstore URL
    (`memory://`, `file://`, `s3://`, `gs://`...), or a kvstore spec `dict` (for
    options a URL cannot carry, such as an S3 `endpoint` or `aws_credentials`).
    """
    if isinstance(path, Location):
        return path
    if isinstance(path, dict):
        return _from_spec(path)
    if isinstance(path, io.IOBase) or hasattr(path, "read") or hasattr(path, "write"):
        raise CheckpointTypeError(
            f"`path` must be a checkpoint directory (a `str` or `pathlib.Path`) or a "
            f"kvstore URL such as 'memory://name/', not a file object "
            f"({type(path).__name__}). eqx_ckpt writes one array per leaf into a "
            f"directory, so pass the directory's path instead."
        )
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise CheckpointTypeError(
            f"`path` must be a `str`, a `pathlib.Path`, a kvstore URL or a kvstore spec `dict`, "
            f"not {type(path).__name__}."
        )
    if "://" not in path:
        local = os.path.abspath(os.path.expanduser(path))
        return Location({"driver": "file", "path": local.rstrip("/") + "/"}, path, local)
    try:
        spec = ts.KvStore.Spec(path).to_json()
    except Exception as e:
        raise CheckpointTypeError(f"{path!r} is not a kvstore URL TensorStore understands: {e}") from None
    return _directory(spec, path)


def _from_spec(spec: dict[str, Any]) -> Location:
    """A kvstore spec dict, e.g. `{"driver": "s3", "bucket": ..., "endpoint": ...}`."""
    try:
        spec = ts.KvStore.Spec(spec).to_json()
    except Exception as e:
        raise CheckpointTypeError(f"{spec!r} is not a kvstore spec TensorStore understands: {e}") from None
    # Messages name the store as a URL; the endpoint and credentials stay out of them
    # (for an http server, its URL without the query string, which may hold a token).
    bucket = spec.get("bucket")
    if spec.get("driver") == "http":
        display = spec["base_url"].split("?", 1)[0] + spec.get("path", "")
    else:
        display = f"{spec.get('driver')}://" + (f"{bucket}/" if bucket else "") + spec.get("path", "")
    return _directory(spec, display)


def _directory(spec: dict[str, Any], display: str) -> Location:
    """The checkpoint directory at a kvstore spec: its path ends in `/`."""
    spec["path"] = spec.get("path", "")
    if spec["path"] and not spec["path"].endswith("/"):
        spec["path"] += "/"
    directory = spec["path"].rstrip("/") if spec.get("driver") == "file" else None
    return Location(spec, display, directory)


def codecs(stored_dtype: str) -> list[dict[str, Any]]:
    """Little-endian bytes, then a crc32c checksum of every chunk."""
    if dtype_from_name(stored_dtype).itemsize > 1:
        first = {"name": "bytes", "configuration": {"endian": "little"}}
    else:
        first = {"name": "bytes"}
    return [first, {"name": "crc32c"}]


@functools.lru_cache(maxsize=256)
def dtype_from_name(name: str) -> np.dtype:
    """The NumPy dtype of a zarr/manifest dtype name (`ml_dtypes` for bfloat16 and co)."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def chunk_shape(shape: tuple[int, ...], itemsize: int, block: tuple[int, ...] | None = None) -> list[int]:
    """A chunk grid that lines up with `block` (a shard's shape) and keeps chunks
    under `CHUNK_BYTES`, so large arrays are read and written in parallel."""
    chunk = [max(1, n) for n in (block if block is not None else shape)]
    while math.prod(chunk) * itemsize > CHUNK_BYTES:
        for axis, n in enumerate(chunk):
            if n > 1:
                # Halving keeps every chunk inside one shard when `n` is even.
                chunk[axis] = n // 2 if n % 2 == 0 else -(-n // 2)
                break
        else:
            break
    return chunk


def array_spec(
    loc: Location, directory: str, *, shape: tuple[int, ...], stored_dtype: str, chunks: list[int]
) -> dict[str, Any]:
    """The spec that creates (or, opened, checks) one leaf's zarr v3 array."""
    return {
        "driver": "zarr3",
        "kvstore": loc.child(directory),
        "metadata": {
            "shape": list(shape),
            "data_type": stored_dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs(stored_dtype),
        },
        # A deleted chunk must be an error, not silently read back as zeros...
        "fill_missing_data_reads": False,
        # ...so every chunk is written, even one that equals the fill value.
        "store_data_equal_to_fill_value": True,
    }
