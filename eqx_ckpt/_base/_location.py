"""Where a checkpoint lives: a `Location`, made once from what the user passed as `path`.

A local path, a TensorStore kvstore URL or spec dict, or a Hugging Face Hub
repository (`hf://`, read by `_hub`, not a kvstore) all become one `Location`.
URLs and spec dicts are normalised by TensorStore's own parser: that is why
this module imports `tensorstore` (everything else goes through `_storage`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import urllib.parse
from typing import Any

import tensorstore as ts

from ._errors import CheckpointTypeError, CheckpointValueError


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint directory: `kvstore`, a spec whose path ends in `/` (empty
    for a `hub` folder); `display`, the path as the user wrote it; `local`,
    the absolute local directory, when it is one. `part`: a local tier's
    directory of one process's parts of its steps, which lack the regions
    of the other processes (every read checks its chunk files first), as
    do the directories below it."""

    kvstore: dict[str, Any]
    display: str
    local: str | None
    hub: Hub | None = None
    part: bool = False

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
        return Location(self.child(relative), display, local, part=self.part)


@dataclasses.dataclass(frozen=True)
class Hub:
    """A folder (`""`, or `"sub/folder/"`) of the Hub model repository `repo`
    (`owner/name`), at a branch, tag or commit (`revision`; `None`: the default)."""

    repo: str
    revision: str | None
    folder: str = ""

    @property
    def path(self) -> str:
        """`hf://owner/name[/folder]`, without the revision."""
        return HUB_SCHEME + self.repo + (f"/{self.folder.rstrip('/')}" if self.folder else "")


def location(path: Any) -> Location:
    """Turn what the user passed as `path` into a `Location`: a local path, a
    kvstore URL (`memory://`, `s3://`...), or a kvstore spec `dict` (for
    options a URL cannot carry, such as an S3 `endpoint`)."""
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
    if path.startswith(HUB_SCHEME):
        return _hub_path(path)
    if "://" not in path:
        local = os.path.abspath(os.path.expanduser(path))
        return Location({"driver": "file", "path": local.rstrip("/") + "/"}, path, local)
    try:
        spec = ts.KvStore.Spec(path).to_json()
    except Exception as e:
        raise CheckpointTypeError(f"{path!r} is not a kvstore URL TensorStore understands: {e}") from None
    return _directory(spec, path)


HUB_SCHEME = "hf://"
# `owner/name`, as the Hub allows them (letters, digits, `-`, `_`, `.`).
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# A branch, tag or commit (`refs/pr/1` holds `/`).
_REVISION = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")


def _hub_path(path: str) -> Location:
    """`hf://owner/name[@revision][/sub/folder]`: a Hub repository's folder (a
    revision holding `/` is written `refs%2Fpr%2F1`, as `huggingface_hub` does)."""
    rest = path[len(HUB_SCHEME) :].strip("/")
    parts = rest.split("/")
    if len(parts) < 2:
        raise CheckpointTypeError(
            f"{path!r} names no repository: write `hf://owner/name` (or `hf://owner/name@revision`)."
        )
    owner, name, *folder = parts
    name, at, revision = name.partition("@")
    repo = f"{owner}/{name}"
    if not _REPO.fullmatch(repo) or (at and not revision) or any(p in ("", ".", "..") for p in folder):
        raise CheckpointTypeError(
            f"{path!r} is not a Hub path eqx_ckpt reads: write `hf://owner/name`, `hf://owner/name@revision` or "
            f"`hf://owner/name@revision/sub/folder` (a revision holding `/` as `%2F`)."
        )
    revision = urllib.parse.unquote(revision) if revision else ""
    if (revision and not _REVISION.fullmatch(revision)) or any(p in (".", "..") for p in revision.split("/")):
        # A revision becomes a path in the Hub's cache (`refs/<revision>`): none may lead out of it.
        raise CheckpointTypeError(
            f"{path!r} names a revision no branch, tag or commit of the Hub has: a revision is letters, digits and "
            f"`-_./`, with no `.` or `..` part (`hf://owner/name@v1.0`, `hf://owner/name@refs%2Fpr%2F1`)."
        )
    sub = "/".join(folder) + "/" if folder else ""
    return Location({}, path, None, Hub(repo, revision or None, sub))


def writable(loc: Location, what: str) -> Location:
    """`loc`, where `what` may write there (a Hub repository is written only by a push)."""
    if loc.hub is not None:
        raise CheckpointValueError(
            f"{what} cannot write to {loc.display!r}: a Hub repository is written only by a push, in one commit. "
            f"Save to a local directory (or a bucket), then publish it: `eqx_ckpt.push_to_hub(tree_or_path, "
            f"{loc.hub.repo!r})`, or `eqx-ckpt push <path> {loc.hub.repo}` (see docs/sharing.md).",
            path=loc.display,
        )
    return loc


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


# What the AWS tools read for an S3-compatible server's URL (the first set wins).
# TensorStore reads neither: without them, an `s3://` URL went to AWS, and on a
# machine that cannot reach AWS waited out the retries.
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# The access keys in the environment, the first place the AWS tools look.
_KEY_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _directory(spec: dict[str, Any], display: str) -> Location:
    """The checkpoint directory at a kvstore spec (its path ends in `/`). An `s3`
    spec takes a missing `endpoint` from `ENDPOINT_VARIABLES`, and missing
    `aws_credentials` from the environment's keys where both are set."""
    spec["path"] = spec.get("path", "")
    endpoint = next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)
    if spec.get("driver") == "s3" and "endpoint" not in spec and endpoint:
        spec["endpoint"] = endpoint
    if spec.get("driver") == "s3" and "aws_credentials" not in spec and all(map(os.environ.get, _KEY_VARIABLES)):
        # The keys AWS's default chain takes first, named: the chain also reads
        # the shared config files, and where there are none the SDK printed
        # errors on stderr that Python cannot quieten.
        spec["aws_credentials"] = {"type": "environment"}
    if spec["path"] and not spec["path"].endswith("/"):
        spec["path"] += "/"
    directory = spec["path"].rstrip("/") if spec.get("driver") == "file" else None
    return Location(spec, display, directory)


def on_local_disk(loc: Location) -> bool:
    """Whether `loc` is a local directory reached through the `file` driver: its
    writes may skip fsync (flushed later), and eqx_ckpt may do its chunk I/O itself."""
    return loc.local is not None and loc.kvstore.get("driver") == "file"
