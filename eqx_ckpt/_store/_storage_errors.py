"""What a storage failure means to the user: TensorStore's and the OS's errors
turned into eqx_ckpt's (unreachable, refused, full, damaged), each saying
where, what was being done, what it left, and what to do."""

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


# curl's codes for a connection never made (TensorStore's `[curl_code='7']`): a
# proxy (5) or host (6) that does not resolve, refused (7), a timeout (28).
_UNREACHABLE = re.compile(r"\[curl_code='(5|6|7|28)'\]")


# TensorStore's codes for storage that answered but would not serve: forbidden
# (403, or file permissions), unauthenticated (401), failing (5xx).
_REFUSED = re.compile(r"^(PERMISSION_DENIED|UNAUTHENTICATED|UNAVAILABLE|ABORTED):")


# The OS's codes for a destination that will not take a write: forbidden,
# read-only, full (EFBIG: past a file size limit), failing.
_WRITE_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


# How TensorStore writes an OS error code: `[os_error_code='28']` or `[OS error 28: ...]`.
_OS_ERROR = re.compile(r"(?:\[OS error |\[os_error_code=')(\d+)")


def write_refusal(error: BaseException) -> type[CheckpointStorageError] | None:
    """The class of error for a write the storage failed: `CheckpointConnectionError`
    (unreachable), `CheckpointStorageError` (forbidden, read-only, full,
    failing), else `None`."""
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
    `what` (a file, a leaf), if `error` says so; else `None`."""
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
    """The error for storage that could not be reached, if `error` says so; else `None`."""
    text = explain(error)
    if not _UNREACHABLE.search(text):
        return None
    return CheckpointConnectionError(f"Cannot reach {loc.display!r}: {text}. {REACH}", path=loc.display)


REACH = (
    "Check the URL (host name and port) and that the server is running and reachable from this machine, then try again."
)


def too_large(loc: Location, name: str, limit: int, size: int | None) -> CorruptCheckpointError:
    shown = f"is {size} bytes, more than the {limit} allowed" if size is not None else f"holds more than {limit} bytes"
    return CorruptCheckpointError(
        f"The file {name!r} of checkpoint {loc.display!r} {shown}, so it "
        f"was not read. The checkpoint is damaged or was not written by eqx_ckpt; do not load it.",
        path=loc.display,
    )


@contextlib.contextmanager
def explained(loc: Location, doing: str) -> Iterator[None]:
    """Turn a storage failure into a `CheckpointError` saying what was being
    done, where, and that nothing was changed."""
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
    """The error of a failed read of the file `name`."""
    refused = storage_failure(loc, error, f"{name!r}")
    if refused is not None:
        return refused
    message = f"Reading {name!r} of checkpoint {loc.display!r} failed: {explain(error)}."
    return CheckpointError(message, path=loc.display)


def write_error(loc: Location, name: str, error: BaseException, outcome: str = "") -> CheckpointError:
    """The error of a write that failed with `error`; `outcome`: what the failure left."""
    so = f", so {outcome}" if outcome else ""
    refused = write_refusal(error)
    if refused is CheckpointConnectionError:
        advice = REACH
    elif _MISSING.match(explain(error)):
        advice = "Check that the bucket exists and that these credentials may write to it."
    else:
        advice = "Check that the destination is writable and has free space."
    return (refused or CheckpointError)(
        f"Cannot write {name!r} in {loc.display!r}{so}: {error}. {advice}", path=loc.display
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
    """A TensorStore error's message, without the long spec it appends."""
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
    """The error of a failed listing of `loc`: unreachable, refused, or no bucket."""
    refused = storage_failure(loc, error, "the listing of its files")
    if refused is not None:
        return refused
    return CheckpointStorageError(
        f"Cannot list the files of {loc.display!r}: {brief(error)}. Check the path (for an object store: that the "
        f"bucket exists) and that these credentials may list it, then try again.",
        path=loc.display,
    )


def missing_bucket(loc: Location, bucket: str) -> CheckpointStorageError:
    """The error of a listing in a bucket that does not exist (which `gcs` lists as empty)."""
    return CheckpointStorageError(
        f"Cannot list the files of {loc.display!r}: the bucket {bucket!r} does not exist (NOT_FOUND). Check the "
        f"bucket's name in the path, then try again.",
        path=loc.display,
    )


def brief(error: BaseException) -> str:
    """`explain`, and without the body of an HTTP answer (an object store's XML)."""
    return re.sub(r"\s*\[http_response_body=.*", "", explain(error), flags=re.S)
