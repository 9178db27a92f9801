"""A folder in memory (a tmpfs: `/dev/shm`), for tests that save and load many
small checkpoints in one process to test eqx_ckpt's own logic (its
transactions, its reaction to a fault or an interrupt at each step), not the
disk. On a busy disk a save's fsyncs and removals took most of their time.

The code a save runs there is the same as on a local disk (the `file` driver,
every fsync and directory sync called), but for files of `UNBUFFERED_FROM`
(8 MiB) or more, which tmpfs cannot write unbuffered (`O_DIRECT`), and for
saves of `SYNCFS_FROM` (256) files or more, which sync each file there where
ext4 has one `syncfs`: a test using it writes neither. Where there is no
`/dev/shm`, or it has less than `FREE_BYTES` free (a container's is often
64 MiB), the test's own `tmp_path` is used."""

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

ROOT = "/dev/shm"
FREE_BYTES = 1 << 30


def _usable() -> bool:
    if not (os.path.isdir(ROOT) and os.access(ROOT, os.W_OK | os.X_OK)):
        return False
    stat = os.statvfs(ROOT)
    return stat.f_bavail * stat.f_frsize >= FREE_BYTES


@contextlib.contextmanager
def folder(fallback: pathlib.Path) -> Iterator[pathlib.Path]:
    """A new, empty folder on the tmpfs, removed afterwards (else `fallback`)."""
    if not _usable():
        yield fallback
        return
    path = pathlib.Path(tempfile.mkdtemp(prefix="eqx_ckpt_test_", dir=ROOT))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
