"""The Hugging Face Hub, a transport of leaves: `hf://` paths read, models published.

Every request is `huggingface_hub`'s own (an optional dependency, imported here
only, at the first Hub call):

- `HfApi.resolve_revision` resolves a revision, and records it in the cache's
  `refs/` (read from there offline).
- `HfApi.model_info` lists the files at that commit; offline, the cache's own
  listing (`get_cached_repo_tree`) does.
- `snapshot_download` downloads whole files into its cache, at the resolved
  commit, with `allow_patterns` naming exactly the files a load reads.
- `HfFileSystem` reads byte ranges.
- `HfApi.create_commit` publishes: the new export's files added and the stale
  files of the published layout deleted, in one commit.

So authentication (`HF_TOKEN`, `hf auth login`, `token=`), the cache
(`HF_HOME`), offline mode (`HF_HUB_OFFLINE`), retries and the Xet transfer path
are the library's.

A branch or tag is resolved to its commit once, when it is opened (`pin`: the
`Pinned` folder its source keeps, `_source.Source.pinned`). Every file is then
read at that commit, which no later push changes. Only the files
`_safetensors`' rules name are fetched (`needed`): no Python file, pickle or
configuration of a repository is downloaded, let alone run. No save reaches
this module: `_storage` never reads a `Location`'s `Hub` reference.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .._base import _faults, _progress, _threads
from .._base._errors import (
    CheckpointConnectionError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    from_file,
    shown_names,
)
from .._base._location import Hub, Location
from .._foreign import _safetensors
from .._foreign._safetensors import INDEX_SUFFIX, SUFFIX
from .._ondisk._format import MAX_MANIFEST_BYTES, MAX_SHARDS
from .._ondisk._manifest import loads_file
from .._ondisk._published import NAME as RECORD
from .._store import _storage, _storage_errors
from .._store._local_paths import local_entry, local_link, local_open, local_real_path, local_walk
from . import _hub_http

# The most of an index `needed` reads (the safetensors reader refuses a larger one).
MAX_INDEX = 100 * 2**20
# Threads downloading whole files, and reading byte ranges, at once.
THREADS = 8
# How often a revision is asked for where the Hub answers 429 or 5xx, and the
# first wait between tries (doubled each time): huggingface_hub retries its
# downloads, not `model_info`. Three tries wait 1.5 s in all.
TRIES = 3
RETRY_SECONDS = 0.5
_RETRIED = (429, 500, 502, 503, 504)
# A commit id, as the Hub writes one: anything else a server answers is refused
# before it names a path of the cache.
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What a file that is code, or that unpickling would run code from, is called
# when a repository holds no model eqx_ckpt reads.
_CODE = (".py",)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5", ".npz", ".joblib")
_LOG = logging.getLogger("eqx_ckpt")


def library() -> Any:
    """`huggingface_hub`, imported at the first Hub call (never by `import eqx_ckpt`)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
    except ImportError:
        raise ImportError(
            "Reading from or publishing to the Hugging Face Hub needs `huggingface_hub`, an optional dependency "
            'of eqx_ckpt: install it with `pip install "eqx_ckpt[hub]"` (in a checkout, `pip install -c '
            'constraints.txt -e ".[hub]"`).'
        ) from None
    return huggingface_hub


@dataclasses.dataclass(frozen=True)
class Pinned:
    """A repository's folder at one commit.

    - `repo`: `owner/name`.
    - `asked`: the revision as the user named it (`None`: the default branch).
    - `sha`: the commit it resolved to.
    - `folder`: the folder within the repository (`""`, or `"sub/folder/"`).
    - `sizes`: the repository's files at `sha`, by path, with their sizes in bytes.
    - `offline`: whether the commit and the files were found in the local cache only.
    - `sha256`: the SHA-256 the Hub lists for each LFS file, by path (none offline).
    - `blob_ids`: the git blob id the Hub lists for each file, by path (none offline).
    - `listed`: whether `sizes` lists every file of the commit (not only those the cache holds).
    - `token`: the token the files are read with (`None`: huggingface_hub's own).
    - `cached`: whether `pin` answered the commit from the cache's listing, online.
    """

    repo: str
    asked: str | None
    sha: str
    folder: str
    sizes: dict[str, int]
    offline: bool
    sha256: dict[str, str] = dataclasses.field(default_factory=dict)
    blob_ids: dict[str, str] = dataclasses.field(default_factory=dict)
    listed: bool = True
    token: str | None = dataclasses.field(default=None, repr=False)
    cached: bool = False

    @property
    def display(self) -> str:
        return f"hf://{self.repo}@{self.sha}" + (f"/{self.folder.rstrip('/')}" if self.folder else "")

    @property
    def hub(self) -> Hub:
        """The folder at its commit."""
        return Hub(self.repo, self.sha, self.folder)

    def files(self) -> dict[str, int]:
        """The files directly in the folder, by name, with their sizes."""
        n = len(self.folder)
        return {p[n:]: s for p, s in self.sizes.items() if p.startswith(self.folder) and "/" not in p[n:]}


# A file of at most this many bytes read whole is kept by its `Files` (an
# index is read to choose the files, then to open the folder).
SMALL_BYTES = 2**20


def pin(where: Hub, token: str | None = None) -> Pinned:
    """Resolve the revision of a `hf://` location to its commit, once, and list its files there.

    A commit whose listing the cache holds is answered from the cache, as
    huggingface_hub does: a commit never changes, so one deleted from the server
    since still loads. Offline (unreachable, or `HF_HUB_OFFLINE`), both come
    from the cache."""
    hub = library()
    repo, asked, folder = where.repo, where.revision, where.folder
    if hub.constants.HF_HUB_OFFLINE:
        return _from_cache(where, hub, token)
    listing = _cached_tree(hub, repo, asked) if asked is not None and _COMMIT.fullmatch(asked) else None
    if listing is not None and asked is not None:
        return Pinned(repo, asked, asked, folder, listing, False, token=token, cached=True)
    api = hub.HfApi(token=token)
    try:
        with _hub_http.guarded():
            # (the default branch by name, as `snapshot_download` asks: a mirror may know no other)
            revision = asked or hub.constants.DEFAULT_REVISION
            sha = _commit(_retried(lambda: api.resolve_revision(repo, revision=revision).resolved), repo, asked)
            files = _files_at(api, repo, sha)
    except Exception as e:
        if not _unreachable(e):
            raise _unpinned(e, api, repo, asked) from None
        return _from_cache(where, hub, token)
    return _listed(files, repo, asked, sha, folder, token)


def _files_at(api: Any, repo: str, sha: str) -> list[tuple[Any, Any, Any, Any]]:
    """Each file at `sha`: its name, size, git blob id and LFS SHA-256, as the
    model info lists them. A mirror's model info may list names alone; then
    the tree listing (as `snapshot_download` reads it) gives them."""
    info = _retried(lambda: api.model_info(repo, revision=sha, files_metadata=True))
    if getattr(info, "sha", sha) != sha:
        raise _refused_listing(repo, sha, f"the listing of another commit ({from_file(repr(info.sha))})")
    siblings = info.siblings
    if siblings is not None and all(s.size is not None for s in siblings):
        return [(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs is not None else None) for s in siblings]
    tree = _retried(lambda: list(api.list_repo_tree(repo, revision=sha, recursive=True)))
    files = [f for f in tree if isinstance(f, library().RepoFile)]  # (not its folders)
    return [(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs is not None else None) for f in files]


def _refused_listing(repo: str, sha: str, what: str) -> CheckpointStorageError:
    return _bad_answer(f"hf://{repo}@{sha}", f"the listing of commit {sha} with {what}")


def _bad_answer(where: str, answered: str) -> CheckpointStorageError:
    return CheckpointStorageError(
        f"{where}: the Hub answered {answered}, so nothing of it is read. Check `HF_ENDPOINT` (a mirror or proxy "
        f"answering for the Hub), and try again.",
        path=where,
    )


def _listed(
    files: list[tuple[Any, Any, Any, Any]], repo: str, asked: str | None, sha: str, folder: str, token: str | None
) -> Pinned:
    """The files at `sha` (`_files_at`), each value checked as the Hub writes it."""
    sizes, sha256, blobs = {}, {}, {}
    for name, size, blob_id, digest in files:
        if not isinstance(name, str) or not _plain_path(name):
            raise _refused_listing(
                repo, sha, f"the file name {from_file(repr(name))}, which is no path in a repository"
            )
        if not (type(size) is int and size >= 0):  # (the Hub lists every file's size)
            raise _refused_listing(repo, sha, f"the size {from_file(repr(size))} for `{from_file(name)}`")
        sizes[name] = size
        if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise _refused_listing(repo, sha, f"the SHA-256 {from_file(repr(digest))} for `{from_file(name)}`")
        if blob_id is not None and not (isinstance(blob_id, str) and _COMMIT.fullmatch(blob_id)):
            raise _refused_listing(repo, sha, f"the git blob id {from_file(repr(blob_id))} for `{from_file(name)}`")
        if digest:
            sha256[name] = digest
        if blob_id:
            blobs[name] = blob_id
    return Pinned(repo, asked, sha, folder, sizes, False, sha256, blobs, token=token)


def _plain_path(name: str) -> bool:
    """Whether `name` is a relative path with no empty, `.` or `..` part, and no control character."""
    parts = name.split("/")
    return name.isprintable() and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def _retried(ask: Callable[[], Any]) -> Any:
    """`ask()`, asked again (`TRIES` in all) while the Hub answers that it is
    rate limited or failed (429, 5xx)."""
    for attempt in range(TRIES):
        try:
            return ask()
        except Exception as e:
            if _status(e) not in _RETRIED or attempt == TRIES - 1:
                raise
        time.sleep(RETRY_SECONDS * 2**attempt)
    raise AssertionError("unreachable")  # (every try returns or raises)


def _status(error: BaseException | None) -> int | None:
    """The HTTP status of `error`, or of what caused it (`resolve_revision`
    wraps a failure it cannot fall back from)."""
    while error is not None:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status is not None:
            return int(status)
        error = error.__cause__
    return None


def _commit(sha: Any, repo: str, asked: str | None) -> str:
    """`sha` where it is a commit id; a server's answer that is not one names no path."""
    if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
        raise _bad_answer(f"hf://{repo}@{asked or 'main'}", f"the revision with no commit id ({from_file(repr(sha))})")
    return sha


def _from_cache(where: Hub, hub: Any, token: str | None) -> Pinned:
    """The commit a revision resolved to when last fetched, and its files as the
    cache lists them (the Hub could not be asked): the cache's own listing of
    the commit (every file, downloaded or not), else the files the cache holds."""
    repo, asked, folder = where.repo, where.revision, where.folder
    try:
        sha = _commit(
            hub.HfApi(token=token).resolve_revision(repo, revision=asked, local_files_only=True).resolved, repo, asked
        )
    except (hub.errors.RevisionResolutionError, CheckpointStorageError):
        sha = None
    snapshot = None if sha is None else _snapshot(hub, repo, sha)
    listing = None if sha is None else _cached_tree(hub, repo, sha)
    if sha is not None and listing is not None:
        return Pinned(repo, asked, sha, folder, listing, True, token=token)
    if sha is None or snapshot is None or not local_entry(os.path.join(snapshot, folder)).folder:
        raise CheckpointConnectionError(
            f"hf://{repo}@{asked or 'main'}: {_why_offline(hub)}, and the local cache ({hub.constants.HF_HUB_CACHE}) "
            f"holds no copy of it. Connect once to fetch it (a whole load keeps it in the cache; `HF_HOME` chooses "
            f"where), then it loads without a network, with `HF_HUB_OFFLINE=1` too.",
            path=f"hf://{repo}",
        )
    sizes = {}
    for base, _, names in local_walk(snapshot):
        for name in names:
            path = os.path.join(base, name)
            sizes[os.path.relpath(path, snapshot).replace(os.sep, "/")] = local_entry(path).size
    return Pinned(repo, asked, sha, folder, sizes, offline=True, listed=False, token=token)


def _cached_tree(hub: Any, repo: str, sha: str) -> dict[str, int] | None:
    """Every file of the commit `sha` with its size, as the cache's own listing
    of it holds them (written by `snapshot_download`), or `None`: no listing."""
    try:
        return {f.path: int(f.size or 0) for f in hub.get_cached_repo_tree(repo, revision=sha)}
    except hub.errors.CachedRepoTreeNotFoundError:
        return None


def _snapshot(hub: Any, repo: str, sha: str) -> str:
    """The cache's folder of `repo` at commit `sha`."""
    name = hub.file_download.repo_folder_name(repo_id=repo, repo_type="model")
    return os.path.join(hub.constants.HF_HUB_CACHE, name, "snapshots", sha)


def _why_offline(hub: Any) -> str:
    return "offline mode is on (`HF_HUB_OFFLINE=1`)" if hub.constants.HF_HUB_OFFLINE else "the Hub cannot be reached"


def _unreachable(error: BaseException) -> bool:
    """Whether `error` says the Hub could not be reached (not that it answered no)."""
    hub = library()
    if isinstance(error, hub.errors.OfflineModeIsEnabled):
        return True
    if isinstance(error, hub.errors.RevisionResolutionError):  # nothing cached to fall back on
        return error.__cause__ is None or _unreachable(error.__cause__)
    try:
        import httpx2

        return isinstance(error, httpx2.TransportError) and not isinstance(error, httpx2.ProxyError)
    except ImportError:  # an older huggingface_hub, on httpx or requests
        return isinstance(error, (ConnectionError, TimeoutError))


def explained(error: BaseException, repo: str, revision: str | None) -> Exception:
    """`huggingface_hub`'s error as one of eqx_ckpt's, naming the repository and revision."""
    hub = library()
    where = f"hf://{repo}@{revision or 'main'}"
    status = _status(error)
    cause: BaseException | None = error
    while cause is not None:  # a server's answer refused inside the library's call, or a stall
        if isinstance(cause, CheckpointError) and isinstance(cause, Exception):
            return cause
        if isinstance(cause, hub.errors.RevisionNotFoundError):  # (the file system wraps it)
            return _no_revision(repo, revision)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, hub.errors.HFValidationError):
        return CheckpointValueError(f"{where}: {_first_line(error)}", path=where)
    if status == 412:
        return CheckpointStorageError(
            f"{where}: another commit landed on the branch while this push was made, so nothing was committed. "
            f"Push again (it is compared with what the branch holds then).",
            path=where,
        )
    if isinstance(error, hub.errors.GatedRepoError):
        return CheckpointStorageError(
            f"{where}: the repository is gated: accept its conditions on its page on the Hub, and pass a token of "
            f"the account that did (`token=`, `HF_TOKEN`, or `hf auth login`).",
            path=where,
        )
    if isinstance(error, hub.errors.RepositoryNotFoundError):
        return CheckpointNotFoundError(
            f"{where}: there is no such repository, or it is private and the token ({_token_said()}) has no access "
            f"to it. Check the name; for a private repository pass a token that can read it (`token=`, `HF_TOKEN`, "
            f"or `hf auth login`).",
            path=where,
        )
    if status in (401, 403):
        return CheckpointStorageError(
            f"{where}: the Hub refused the token ({_token_said()}): HTTP {status}. Pass a token with access to the "
            f"repository (`token=`, `HF_TOKEN`, or `hf auth login`). ({_first_line(error)})",
            path=where,
        )
    if _unreachable(error):
        return CheckpointConnectionError(
            f"{where}: the Hub cannot be reached ({_first_line(error)}). A repository loaded whole once loads from "
            f"the local cache without a network (`HF_HUB_OFFLINE=1` skips the network at once).",
            path=where,
        )
    what = "rate limited (HTTP 429)" if status == 429 else f"failed (HTTP {status})" if status else "failed"
    return CheckpointStorageError(
        f"{where}: the Hub {what}, after {TRIES} tries: {_first_line(error)}. Try again later.",
        path=where,
    )


def _unpinned(error: BaseException, api: Any, repo: str, asked: str | None) -> Exception:
    """Why `asked` could not be pinned (`explained`). A 401 for a revision of
    a repository the server lists refs of (a mirror's answer to a missing
    revision) is a missing revision, not a missing repository."""
    if asked is not None and _status(error) == 401 and isinstance(error, library().errors.RepositoryNotFoundError):
        try:
            with _hub_http.guarded():
                api.list_repo_refs(repo)
        except Exception:
            pass
        else:
            return _no_revision(repo, asked, unauthorised=True)
    return explained(error, repo, asked)


def _no_revision(
    repo: str, revision: str | None, missing: list[str] | None = None, *, unauthorised: bool = False
) -> CheckpointNotFoundError:
    """The server gives no `revision` of `repo`: a commit gone from it, of
    which the cache lacks `missing` (`None`: the files a load reads), or a
    name that names nothing (or nothing the token may read: `unauthorised`)."""
    where = f"hf://{repo}@{revision or 'main'}"
    refs = f"`huggingface_hub.list_repo_refs({repo!r})` lists its branches and tags"
    if revision is not None and _COMMIT.fullmatch(revision):
        lacks = f"lacks {shown_names(missing)} of it" if missing else "does not hold the files a load of it reads"
        return CheckpointNotFoundError(
            f"{where}: the server no longer gives this commit (deleted, its branch rewritten, or the repository "
            f"gone), and the local cache ({library().constants.HF_HUB_CACHE}) {lacks}, so it cannot be loaded. Load "
            f"a revision the repository has ({refs}), or a copy of this one kept elsewhere.",
            path=where,
        )
    said = (
        f"the server answered HTTP 401 for the revision {revision!r} of a repository it holds: there is no such "
        f"revision, or the token ({_token_said()}) may not read it"
        if unauthorised
        else f"the repository has no revision {revision!r} (a branch, a tag or a commit)"
    )
    return CheckpointNotFoundError(f"{where}: {said}. Check the name; {refs}.", path=where)


def _token_said() -> str:
    return "one was given" if library().get_token() is not None else "none was given"


def _first_line(error: BaseException) -> str:
    """The first line of `error`, and of what caused it (huggingface_hub wraps a failed upload)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    said = f"{type(error).__name__}: {from_file(lines[0]) if lines else ''}".strip()  # (a server's words)
    cause = error.__cause__
    return said + (f", caused by {_first_line(cause)}" if cause is not None and cause is not error else "")


def needed(pinned: Pinned, read_index: Callable[[str], bytes]) -> list[str]:
    """The files of the pinned folder a load reads: the safetensors files (an
    index and its shards, or one file), and `eqx_ckpt.json` where it is there.

    A folder with no safetensors file, or with two layouts at once
    (`_safetensors.ambiguous`), raises, saying what it holds. A commit answered
    from the cache (`Pinned.cached`) that lacks some of them is asked of the
    server: one it no longer gives is named, with what the cache lacks."""
    names = _needed(pinned, read_index)
    missing = _uncached(pinned, names) if pinned.cached else []
    if missing:
        try:
            with _hub_http.guarded():
                library().HfApi(token=pinned.token).model_info(pinned.repo, revision=pinned.sha)
        except Exception as e:
            if isinstance(explained(e, pinned.repo, pinned.asked), CheckpointNotFoundError):
                raise _no_revision(pinned.repo, pinned.sha, missing) from None
    return names


def _needed(pinned: Pinned, read_index: Callable[[str], bytes]) -> list[str]:
    files = pinned.files()
    indexes, singles = _safetensors.layout(files)
    extras = [RECORD] if RECORD in files else []
    if not pinned.listed and not indexes and not singles:
        raise CheckpointConnectionError(_partly_cached(pinned, []), path=pinned.display)
    both = _safetensors.ambiguous(files)
    if both is not None:
        raise _two_layouts(pinned, both)
    _refuse_large(pinned, {**{n: MAX_INDEX for n in indexes}, **{n: MAX_MANIFEST_BYTES for n in extras}})
    if indexes:
        shards = _shards(pinned, indexes[0], read_index(indexes[0]))
        both = _safetensors.ambiguous(files, indexes[0], shards)
        if both is not None:
            raise _two_layouts(pinned, both)
        return [indexes[0], *shards, *extras]
    if len(singles) > 1:
        raise _two_layouts(pinned, f"{len(singles)} safetensors files and no index ({shown_names(singles)})")
    if singles:
        return [singles[0], *extras]
    raise CheckpointNotFoundError(_holds_nothing(pinned), path=pinned.display)


def _refuse_large(pinned: Pinned, limits: dict[str, int]) -> None:
    """Refuse a small file (an index, `eqx_ckpt.json`) the Hub lists larger than its limit, before it is read."""
    for name, limit in limits.items():
        size = pinned.files().get(name, 0)
        if size > limit:
            raise CorruptCheckpointError(
                f"{pinned.display}: `{from_file(name)}` is listed at {size} bytes, more than the {limit} eqx_ckpt "
                f"reads of it, so nothing was downloaded. It is no index or record a save writes.",
                path=pinned.display,
            )


def _two_layouts(pinned: Pinned, held: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{pinned.display} holds two safetensors layouts at once: {held}. Which one is the model is not said, "
        f"so nothing is loaded. Delete the stale one from the repository (a push by `eqx_ckpt.push_to_hub` "
        f"deletes it), or load a commit that held one.",
        path=pinned.display,
    )


def _partly_cached(pinned: Pinned, missing: list[str]) -> str:
    """Why an offline load of a folder the cache holds only part of cannot be made."""
    hub = library()
    held = sorted(pinned.files())
    what = (
        f"of the files the load reads, it lacks {shown_names(missing)}"
        if missing
        else f"it holds only {shown_names(held) if held else 'no file'} of it, not its weights"
    )
    return (
        f"{pinned.display}: {_why_offline(hub)}, and the local cache ({hub.constants.HF_HUB_CACHE}) holds part of "
        f"this commit: {what} (a download that was interrupted, or of single files). Connect once to fetch the "
        f"rest (a whole load keeps it in the cache), then it loads without a network."
    )


def _shards(pinned: Pinned, index: str, data: bytes) -> list[str]:
    """The shards an index names that are files of the folder (the safetensors
    reader refuses the others); a name that is no safetensors file is refused
    before anything is downloaded."""
    try:
        weight_map = loads_file(data).get("weight_map", {})
        names = {v for v in weight_map.values() if isinstance(v, str)}
    except (ValueError, AttributeError):
        return []
    if len(names) > MAX_SHARDS:
        raise CorruptCheckpointError(
            f"{pinned.display}: the index `{from_file(index)}` names {len(names)} shards, more than the {MAX_SHARDS} "
            f"eqx_ckpt reads (real models use a few hundred at most), so nothing was downloaded.",
            path=pinned.display,
        )
    other = sorted(n for n in names if not _safetensors.is_shard(n))
    if other:
        raise CorruptCheckpointError(
            f"{pinned.display}: the index `{from_file(index)}` names {shown_names(other)} as shards, which are no "
            f"safetensors files beside it, so nothing was downloaded. eqx_ckpt reads only `*{SUFFIX}` shards.",
            path=pinned.display,
        )
    if not pinned.listed:  # offline: a shard the cache lacks is named as missing, not refused
        missing = sorted(n for n in names if n not in pinned.files() and "/" not in n)
        if missing:
            raise CheckpointConnectionError(_partly_cached(pinned, missing), path=pinned.display)
    return sorted(n for n in names if n in pinned.files())


def _holds_nothing(pinned: Pinned) -> str:
    files = sorted(pinned.files())
    code = [n for n in files if n.endswith(_CODE)]
    pickles = [n for n in files if n.endswith(_PICKLES)]
    held = []
    if pickles:
        held.append(f"pickled or framework weights ({shown_names(pickles)}), which eqx_ckpt never reads")
    if code:
        held.append(f"Python code ({shown_names(code)}), which eqx_ckpt never runs")
    rest = [n for n in files if n not in code and n not in pickles]
    if rest:
        held.append(f"other files ({shown_names(rest)})")
    folders = sorted(
        {p[len(pinned.folder) :].split("/")[0] for p in pinned.sizes if p.startswith(pinned.folder)} - set(files)
    )
    if folders:
        held.append(f"folders ({shown_names(folders)}; name one as `hf://{pinned.repo}@{pinned.sha}/<folder>`)")
    holds = "; ".join(held) if held else "no files"
    return (
        f"{pinned.display} holds no model eqx_ckpt reads (no `*{SUFFIX}` file, no `*{INDEX_SUFFIX}`): it holds "
        f"{holds}. eqx_ckpt loads safetensors weights, with `{RECORD}` for the structure where there is one."
    )


def reader(files: Files, *, whole: bool) -> Callable[[str], bytes]:
    """How `needed` reads an index: from the cache for a whole load or one
    cached already (downloaded first), else by one read of `files`, which keeps it."""
    pinned = files.pinned

    def read(name: str) -> bytes:
        if whole or pinned.offline or cached(pinned, [name]):
            with local_open(os.path.join(download(pinned, [name])[0], name)) as f:
                return f.read(MAX_INDEX + 1)
        data, _ = files.read(name).result()
        return data or b""

    return read


def cached(pinned: Pinned, names: Iterable[str]) -> bool:
    """Whether every one of `names` is in the local cache at the pinned commit."""
    return not _uncached(pinned, names)


def _uncached(pinned: Pinned, names: Iterable[str]) -> list[str]:
    hub = library()
    return [
        n
        for n in names
        if not isinstance(hub.try_to_load_from_cache(pinned.repo, pinned.folder + n, revision=pinned.sha), str)
    ]


def download(pinned: Pinned, names: list[str]) -> tuple[str, tuple[str, ...]]:
    """Download `names` of the pinned folder into the Hub's cache at the pinned
    commit (`snapshot_download`: those there already are not fetched again);
    return the local folder and what was checked of them, as `verify` says it.

    Offline, those missing are named. Each must lie in the cache, with the size
    and digest the Hub listed (`_check_digests`). huggingface_hub's bars show
    only from `_progress.MIN_BYTES`, as eqx_ckpt's do (`ls` and `info` show none)."""
    hub = library()
    if pinned.offline:
        missing = _uncached(pinned, names)
        if missing:
            raise CheckpointConnectionError(_partly_cached(pinned, missing), path=pinned.display)
    revision = hub.ResolvedRevision(pinned.sha, pinned.asked, repo_id=pinned.repo, repo_type="model")
    try:
        with _hub_http.guarded():
            snapshot = hub.snapshot_download(
                pinned.repo,
                revision=revision,
                allow_patterns=[glob.escape(pinned.folder + n) for n in names],
                token=pinned.token,
                headers={_hub_http.MARK: "1"},
                local_files_only=pinned.offline,
                max_workers=THREADS,
                tqdm_class=None if _large(pinned, names) else _quiet(hub),
            )
    except Exception as e:
        raise explained(e, pinned.repo, pinned.asked) from None
    local = os.path.join(str(snapshot), *pinned.folder.split("/"))
    cache = local_real_path(hub.constants.HF_HUB_CACHE) + os.sep
    for name in names:
        path = os.path.join(local, name)
        expected = pinned.sizes.get(pinned.folder + name)
        entry = local_entry(path)
        size = entry.size if entry.file else None
        if not local_real_path(path).startswith(cache):
            raise _damaged(pinned, name, f"leads out of the cache ({hub.constants.HF_HUB_CACHE}), by a link")
        if size is None or (expected is not None and size != expected):
            raise _damaged(pinned, name, f"was downloaded as {size} bytes, but the Hub lists {expected}")
    return local, _check_digests(pinned, local, names)


def _damaged(pinned: Pinned, name: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{pinned.display}: `{from_file(name)}` {what}. The download or the cache is damaged: delete the file from "
        f"the cache (`hf cache rm`) and load again.",
        path=pinned.display,
    )


def _large(pinned: Pinned, names: list[str]) -> bool:
    """Whether `names` are worth a bar: their listed bytes reach `_progress.MIN_BYTES`."""
    return sum(pinned.sizes.get(pinned.folder + n) or 0 for n in names) >= _progress.MIN_BYTES


def _quiet(hub: Any) -> type:
    """A huggingface_hub bar that never shows (for this call only: no setting of the library changes)."""

    class Quiet(hub.utils.tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **{**kwargs, "disable": True})

    return Quiet


def _check_digests(pinned: Pinned, local: str, names: list[str]) -> tuple[str, ...]:
    """Refuse a file of a whole load whose digest is not the commit's (an LFS
    file's SHA-256, any other's git blob id); what was checked, a sentence a file."""
    listed = [(n, *_listed_digest(pinned, local, n)) for n in sorted(names)]
    listed = [(n, lfs, digest, said) for n, lfs, digest, said in listed if digest is not None]
    hashing = _pool().map if len(listed) > 1 else map  # (one file: in this thread, maybe the pool's own)
    got = hashing(lambda item: _digest(os.path.join(local, item[0]), lfs=item[1]), listed)
    checked = []
    for (name, lfs, digest, said), found in zip(listed, got):
        kind = "SHA-256" if lfs else "git blob id"
        if found != digest:
            raise _damaged(pinned, name, f"has the {kind} {found}, but {said} {digest} at {pinned.sha}")
        checked.append(f"`{from_file(name)}`: its {kind} is the one {said} at {pinned.sha}")
    return tuple(checked)


def _listed_digest(pinned: Pinned, local: str, name: str) -> tuple[bool, str | None, str]:
    """Whether `name` is an LFS file, the digest it must have, and who said so:
    the Hub's listing, else the name of its blob in the cache (huggingface_hub
    names it after the `ETag` the server sent)."""
    listed = pinned.sha256.get(pinned.folder + name) or pinned.blob_ids.get(pinned.folder + name)
    if listed is not None:
        return pinned.folder + name in pinned.sha256, listed, "the Hub lists"
    path = os.path.join(local, name)
    blob = os.path.basename(local_link(path)) if local_entry(path).link else ""
    known = _SHA256.fullmatch(blob) or _COMMIT.fullmatch(blob)
    return len(blob) == 64, blob if known else None, "the cache recorded"


def _digest(path: str, *, lfs: bool) -> str:
    """A file's SHA-256 (`lfs`, as the Hub lists an LFS file), or its git blob id."""
    digest = hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % local_entry(path).size)
    with local_open(path) as f:
        for block in iter(lambda: f.read(2**22), b""):
            digest.update(block)
    return digest.hexdigest()


class Files:
    """The files of a pinned folder, read by byte ranges through `HfFileSystem`
    at the commit: the `_safetensors.Folder` `_safetensors.find` reads. A small
    file read whole is kept (a commit's files never change).

    Where a server answers a range with the whole file (a mirror ignoring
    `Range`), each file is downloaded whole into the cache instead (`download`,
    which checks it), with one line logged."""

    def __init__(self, pinned: Pinned):
        self.pinned = pinned
        self.loc = Location({}, pinned.display, None, pinned.hub)
        # Its own (the library keeps every one it makes, with its token, unless told not to).
        self.fs = library().HfFileSystem(token=pinned.token, skip_instance_cache=True)
        self.small: dict[str, bytes] = {}
        self.whole: dict[str, str] | None = None  # where ranges are ignored: each file downloaded, by name
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.pinned.files())

    def read(self, name: str, byte_range: slice | None = None) -> _storage.Mapped:
        """A future of a `_storage.Found`, its generation the commit; a range past
        the end fails with `OUT_OF_RANGE`, as TensorStore's reads do."""
        return _storage.Mapped(_pool().submit(self._read, name, byte_range), lambda found: _storage.Found(*found))

    def read_file(self, name: str, *, limit: int) -> bytes | None:
        """A small file (`eqx_ckpt.json`), or `None`: downloaded into the Hub's
        cache (`download`, which checks it), so that a whole load after this
        open finds it there and does not fetch it again."""
        if self.listed_size(name) is None:
            return None
        with local_open(os.path.join(download(self.pinned, [name])[0], name)) as f:
            data = f.read(limit + 1)  # (its listed size was checked: `needed`)
        if len(data) > limit:
            raise _storage_errors.too_large(self.loc, name, limit, len(data))
        return data

    def listed_size(self, name: str) -> int | None:
        """The bytes of the file `name`, as the commit's listing gives them (`None`: not listed)."""
        return self.pinned.sizes.get(self.pinned.folder + name)

    def changed(self, name: str, generation: bytes) -> bool:
        return False  # (a commit's files do not change)

    def _read(self, name: str, byte_range: slice | None) -> tuple[bytes | None, bytes]:
        if byte_range is None and name in self.small:  # an index read again, as the folder is opened
            return self.small[name], self.pinned.sha.encode()
        data, generation = self._fetch(name, byte_range)
        if byte_range is None and data is not None and len(data) <= SMALL_BYTES:
            self.small[name] = data
        return data, generation

    def _fetch(self, name: str, byte_range: slice | None) -> tuple[bytes | None, bytes]:
        generation = self.pinned.sha.encode()
        size = self.listed_size(name)
        if size is None:
            return None, b""
        start = 0 if byte_range is None else byte_range.start or 0
        stop = size if byte_range is None or byte_range.stop is None else min(byte_range.stop, size)
        if start > size:
            raise OSError(f"OUT_OF_RANGE: bytes {start}.. of `{name}`, which has {size}")
        if stop <= start:
            return b"", generation
        if self.whole is not None:
            return self._downloaded(name, start, stop), generation
        path = f"{self.pinned.repo}@{self.pinned.sha}/{self.pinned.folder}{name}"
        try:
            with _hub_http.guarded(), self.fs.open(path, "rb", block_size=max(stop - start, 1), cache_type="none") as f:
                f.seek(start)
                data = f.read(stop - start)
        except Exception as e:
            error = explained(e, self.pinned.repo, self.pinned.asked)
            if not isinstance(error, _hub_http.RangeIgnored):
                raise error from None
            return self._downloaded(name, start, stop, error), generation
        if len(data) != stop - start:
            raise CheckpointStorageError(
                f"{self.pinned.display}: the Hub answered bytes {start} to {stop} of `{from_file(name)}` with "
                f"{len(data)} bytes, so they were not used. Check `HF_ENDPOINT` (a mirror or proxy answering for "
                f"the Hub), and try again.",
                path=self.pinned.display,
            )
        return bytes(data), generation

    def _downloaded(self, name: str, start: int, stop: int, why: Exception | None = None) -> bytes:
        """Bytes `start:stop` of `name`, downloaded whole into the cache once."""
        with self.lock:
            if self.whole is None:
                self.whole = {}
                _LOG.warning(
                    "%s %s is read from whole files instead, each downloaded into the cache once and checked.",
                    why,
                    self.pinned.display,
                )
            if name not in self.whole:
                self.whole[name] = os.path.join(download(self.pinned, [name])[0], name)
            path = self.whole[name]
        with local_open(path) as f:
            f.seek(start)
            return f.read(stop - start)


def _pool() -> _threads.Pool:
    """The pool reading byte ranges and hashing downloaded files (`_threads` stops it at exit)."""
    return _threads.pool("eqx_ckpt-hub-read", THREADS * 2)


@dataclasses.dataclass(frozen=True)
class Published:
    """What a push did: the commit that holds the export, and whether it made it
    (`False`: the branch held exactly these files already, and nothing was committed)."""

    commit: str
    changed: bool


def publish(write: Callable[[str], list[str]], options: Any, token: str | None) -> Published:
    """Make the branch hold exactly the files `write(folder)` writes (and names),
    in one commit; `options` are the push's (`_publish.PushOptions`).

    The repository and the branch (from the default one) are made where there
    are none. Files of the published layout at the root that `write` did not
    write (`_safetensors.is_published`) are deleted in the same commit; every
    other file stays. Where the branch holds these files already, nothing is
    committed. `tag` tags the commit that holds them. A push that made the
    repository and fails (or is interrupted) before its commit deletes it
    again while it is still empty (`_undo_creation`)."""
    hub = library()
    api = hub.HfApi(token=token)
    repo, revision = options.repo_id, options.revision
    where = f"hf://{repo}@{revision or 'main'}"
    with tempfile.TemporaryDirectory(prefix="eqx_ckpt-push-") as folder:
        names = write(folder)
        created = False
        try:
            created = _create_repo(hub, api, repo, options.private)
            published = _commit_files(hub, api, options, folder, names)
        except BaseException as e:
            left = _undo_creation(api, repo, revision) if created else None
            if not isinstance(e, Exception):
                raise  # (an interrupt reaches the caller as itself; `_undo_creation` logged what it left)
            error = e if isinstance(e, (CheckpointTypeError, CheckpointValueError, CheckpointStorageError)) else None
            raised = error or explained(e, repo, revision)
            if left and isinstance(raised, CheckpointError):  # (what `explained` gives, as the three above)
                raised = type(raised)(f"{raised} {left}", path=raised.path or where)
            raise raised from None
    if not published.changed:
        _LOG.info("%s already holds this export at %s: nothing was committed.", where, published.commit)
    return published


def _commit_files(hub: Any, api: Any, options: Any, folder: str, names: list[str]) -> Published:
    """`publish`'s commit of the files `names` of `folder`, into a repository that exists."""
    repo, revision = options.repo_id, options.revision
    if revision is not None:
        api.create_branch(repo, branch=revision, exist_ok=True)
    info = _retried(lambda: api.model_info(repo, revision=revision, files_metadata=True))
    parent = _commit(info.sha, repo, revision)
    held = {s.rfilename: s for s in info.siblings or ()}
    added = [n for n in names if not _same(held.get(n), os.path.join(folder, n))]
    deleted = sorted(p for p in held if p not in names and _safetensors.is_published(p))
    commit = parent
    if added or deleted:
        operations = [hub.CommitOperationAdd(n, os.path.join(folder, n)) for n in added]
        operations += [hub.CommitOperationDelete(p) for p in deleted]
        _faults.fire("hub.commit", repo, revision)
        with warnings.catch_warnings():
            # huggingface_hub's LFS upload (where the Hub offers no Xet) hands
            # httpx2 bytes as `data=`, which httpx2 deprecates: the library's
            # own call, which nothing here can change.
            warnings.filterwarnings("ignore", "Use 'content=<...>'", DeprecationWarning)
            made = api.create_commit(
                repo, operations, commit_message=options.commit_message, revision=revision, parent_commit=parent
            )
        commit = _commit(str(made.oid), repo, revision)
    if options.tag is not None:
        _tag(hub, api, repo, options.tag, commit)
    return Published(commit, bool(added or deleted))


def _create_repo(hub: Any, api: Any, repo: str, private: bool) -> bool:
    """Make the repository where there is none: whether this call made it."""
    try:
        api.create_repo(repo, private=private)
        return True
    except hub.errors.HfHubHTTPError as e:
        if _status(e) != 409:  # (401-403 may still mean "it exists": huggingface_hub's own check follows)
            api.create_repo(repo, private=private, exist_ok=True)
    return False


def _undo_creation(api: Any, repo: str, revision: str | None) -> str | None:
    """Delete the repository a failed push made, if nothing was committed to it
    (it holds no file but the `.gitattributes` the Hub makes). `None` once it is
    gone or not empty; else the sentence saying it is left, and how to remove it."""
    try:
        branches = api.list_repo_refs(repo).branches
        empty = all(
            {s.rfilename for s in api.model_info(repo, revision=b.target_commit).siblings or ()} <= {".gitattributes"}
            for b in branches
        )
        if not empty:
            return None
        api.delete_repo(repo)
        _LOG.info("hf://%s: this push made the repository and failed before its commit: it was deleted.", repo)
        return None
    except Exception as e:
        left = (
            f"This push created the repository hf://{repo}, which is still empty, and could not delete it "
            f"({_first_line(e)}). Push again, or delete it: `huggingface_hub.delete_repo({repo!r})`."
        )
        _LOG.warning("%s", left)
        return left


def _same(listed: Any, path: str) -> bool:
    """Whether the repository's file `listed` (a sibling of the model info) holds
    the bytes of the local file at `path`: its LFS SHA-256, or its git blob id."""
    if listed is None or listed.size is None or int(listed.size) != local_entry(path).size:
        return False
    lfs = getattr(listed, "lfs", None)
    return _digest(path, lfs=lfs is not None) == (lfs.sha256 if lfs is not None else listed.blob_id)


def _tag(hub: Any, api: Any, repo: str, tag: str, commit: str) -> None:
    """Tag `commit`; a tag that is there already must name it."""
    try:
        api.create_tag(repo, tag=tag, revision=commit)
    except hub.errors.HfHubHTTPError as e:
        if _status(e) != 409:
            raise
        tagged = _commit(api.resolve_revision(repo, revision=tag).resolved, repo, tag)
        if tagged != commit:
            raise CheckpointValueError(
                f"hf://{repo}: the tag {tag!r} names another commit ({tagged}), so it was not moved to {commit} "
                f"(which holds the export). Choose a new tag, or delete the old one "
                f"(`huggingface_hub.delete_tag({repo!r}, tag={tag!r})`) and push again.",
                path=f"hf://{repo}",
            ) from None
