"""What a storage failure means to the user.

TensorStore's and the OS's errors are turned into eqx_ckpt's: unreachable,
refused, full, damaged. Each says where, what was being done, what the failure
left, and what to do."""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._base._errors import (
    CheckpointConnectionError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointTypeError,
    CorruptCheckpointError,
    IntegrityError,
    stored_leaf_error,
)

if TYPE_CHECKING:
    from .._base._location import Location
    from .._ondisk._format import LeafRecord


# curl's codes for a connection that was never made: a proxy (5) or host (6)
# name that does not resolve, a refused connection (7), a timeout (28).
# TensorStore reports them, once its retries are spent, as `[curl_code='7']`.
_UNREACHABLE = re.compile(r"\[curl_code='(5|6|7|28)'\]")


# TensorStore's codes for storage that answered but would not serve: forbidden
# (HTTP 403, or a local file's permissions), unauthenticated (401), failing
# (5xx: `ABORTED: All 4 retry attempts failed`, or `UNAVAILABLE`).
_REFUSED = re.compile(r"^(PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE|ABORTED):")


# The OS's codes for a destination that will not take a write: forbidden
# (EACCES, EPERM), read-only (EROFS), full (ENOSPC, EDQUOT, and EFBIG past a
# file size limit), failing (EIO). TensorStore writes them as `[os_error_code='28']`
# (or `[OS error 28: ...]`).
_WRITE_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


_OS_ERROR = re.compile(r"(?:\[OS error |\[os_error_code=')(\d+)")


def write_refusal(error: BaseException) -> type[CheckpointStorageError] | None:
    """The class of error for a write that failed with `error` (TensorStore's or
    the OS's) because of the storage: `CheckpointConnectionError` when it could
    not be reached, `CheckpointStorageError` when it would not take the write
    (forbidden, read-only, full, failing), else `None`."""
    if isinstance(error, CheckpointStorageError):
        return type(error)
    text = explain(error)
    if _UNREACHABLE.search(text):
        return CheckpointConnectionError
    codes = {int(code) for code in _OS_ERROR.findall(text)}
    if isinstance(error, OSError) and error.errno is not None:
        codes.add(error.errno)
    if _REFUSED.match(text) or _MISSING.match(text) or codes & _WRITE_REFUSED:
        return CheckpointStorageError
    return None


# An object store's answer to a write into a bucket that does not exist (GCS's
# 404; an object write is never "not found" otherwise).
_MISSING = re.compile(r"^NOT_FOUND:")


def storage_failure(loc: Location, error: BaseException, what: str) -> CheckpointStorageError | None:
    """The error for storage that could not be reached or would not serve
    `what` (a file, a leaf), if `error` (TensorStore's) says so; `None` for any
    other failure."""
    connection = unreachable(loc, error)
    text = explain(error)
    if connection is not None or not _REFUSED.match(text):
        return connection
    return CheckpointStorageError(
        f"The storage would not serve {what} of checkpoint {loc.display!r}: {brief(error)}. The checkpoint may well be "
        f"whole: check that you may read it (credentials, permissions) and that the storage works, then try again.",
        path=loc.display,
    )


def unreachable(loc: Location, error: BaseException) -> CheckpointConnectionError | None:
    """The error for storage that could not be reached, if `error` (TensorStore's)
    says so; `None` for any other failure."""
    text = explain(error)
    if not _UNREACHABLE.search(text):
        return None
    return CheckpointConnectionError(f"Cannot reach {loc.display!r}: {text}. {REACH}", path=loc.display)


REACH = (
    "Check the URL (host name and port) and that the server is running and reachable from this machine, then try again."
)


def write_advice(refused: type[CheckpointStorageError] | None, error: BaseException) -> str:
    """What to do about a write that failed with `error` (`refused`:
    `write_refusal`'s class): reach the storage, create the bucket, or free
    space and check permissions."""
    if refused is CheckpointConnectionError:
        return REACH
    if _MISSING.match(explain(error)):
        return "Check that the bucket exists and that these credentials may write to it."
    return "Check that the destination is writable and has free space."


def too_large(loc: Location, name: str, limit: int, size: int | None) -> CorruptCheckpointError:
    shown = f"is {size} bytes, more than the {limit} allowed" if size is not None else f"holds more than {limit} bytes"
    return CorruptCheckpointError(
        f"The file {name!r} of checkpoint {loc.display!r} {shown}, so it "
        f"was not read. The checkpoint is damaged or was not written by eqx_ckpt; do not load it.",
        path=loc.display,
    )


@contextlib.contextmanager
def explained(loc: Location, doing: str) -> Iterator[None]:
    """Turn a storage failure (TensorStore's or the OS's) into a `CheckpointError`
    saying what was being done, where, and that nothing was changed."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise (write_refusal(e) or CheckpointError)(
            f"{doing} {loc.display!r} failed, and nothing was changed: {e}. Check that the storage is reachable "
            f"and writable, then try again.",
            path=loc.display,
        ) from e


@contextlib.contextmanager
def read_explained(loc: Location, name: str) -> Iterator[None]:
    """Turn a failed read of the file `name` into `read_error`'s error."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise read_error(loc, name, e) from e


def read_error(loc: Location, name: str, error: BaseException) -> CheckpointError:
    """The error of a failed read of the file `name` (TensorStore's `error`,
    once its retries were spent)."""
    refused = storage_failure(loc, error, f"{name!r}")
    if refused is not None:
        return refused
    message = f"Reading {name!r} of checkpoint {loc.display!r} failed: {explain(error)}."
    return CheckpointError(message, path=loc.display)


def write_error(loc: Location, name: str, error: BaseException, outcome: str = "") -> CheckpointError:
    """The error of a write that failed with `error`, in words (a full disk, a
    read-only or forbidden destination); `outcome`: what the failure left."""
    so = f", so {outcome}" if outcome else ""
    refused = write_refusal(error)
    return (refused or CheckpointError)(
        f"Cannot write {name!r} in {loc.display!r}{so}: {error}. {write_advice(refused, error)}", path=loc.display
    )


def read_only_store(loc: Location) -> CheckpointTypeError:
    """The error for a store that cannot list or write keys (http)."""
    driver = loc.kvstore.get("driver")
    return CheckpointTypeError(
        f"{loc.display!r} is on a store that cannot list its keys (TensorStore's {driver!r} driver), so "
        f"eqx_ckpt cannot save or manage checkpoints there. Save to a local directory or an object store "
        f"(s3://, gs://); a checkpoint can still be loaded over http.",
        path=loc.display,
    )


def explain(error: BaseException) -> str:
    """A TensorStore error's message, without the whole spec it appends (every
    context resource, the metadata: noise to a user, and long)."""
    return re.sub(r"\s*\[(tensorstore_spec|source locations)='.*?'\]", "", str(error), flags=re.S)


def leaf_io_error(error: BaseException, record: LeafRecord, loc: Location, doing: str) -> CheckpointError:
    """Explain a TensorStore failure on one leaf."""
    if isinstance(error, CheckpointError):
        return error
    refused = storage_failure(loc, error, f"leaf `{record.path}`")
    if refused is not None:
        return refused
    text = explain(error)
    if "NOT_FOUND" in text or "DATA_LOSS" in text or "FAILED_PRECONDITION" in text or "digest" in text.lower():
        return stored_leaf_error(
            IntegrityError,
            f"it is damaged or incomplete: {text}.",
            dotted=record.path,
            path=loc.display,
            fix="Its bytes do not match what was saved. If the checkpoint was overwritten or deleted while this "
            "read ran, read it again; otherwise restore it from a good copy, or run `eqx-ckpt verify` to list "
            "every damaged leaf.",
        )
    return stored_leaf_error(IntegrityError, f"could not {doing} it: {text}", dotted=record.path, path=loc.display)


def list_error(loc: Location, error: BaseException) -> CheckpointStorageError:
    """The error of a listing of `loc` that failed (TensorStore's `error`, once
    its retries were spent): unreachable, refused, or a bucket that is not there."""
    refused = storage_failure(loc, error, "the listing of its files")
    if refused is not None:
        return refused
    return CheckpointStorageError(
        f"Cannot list the files of {loc.display!r}: {brief(error)}. Check the path (for an object store: that the "
        f"bucket exists) and that these credentials may list it, then try again.",
        path=loc.display,
    )


def missing_bucket(loc: Location, bucket: str) -> CheckpointStorageError:
    """The error of a listing of `loc` in a bucket that does not exist (which
    TensorStore's `gcs` driver lists as empty)."""
    return CheckpointStorageError(
        f"Cannot list the files of {loc.display!r}: the bucket {bucket!r} does not exist (NOT_FOUND). Check the "
        f"bucket's name in the path, then try again.",
        path=loc.display,
    )


def brief(error: BaseException) -> str:
    """`explain`, and without the body of an HTTP answer (an object store's XML)."""
    return re.sub(r"\s*\[http_response_body=.*", "", explain(error), flags=re.S)
