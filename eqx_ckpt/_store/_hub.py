"""The Hugging Face Hub, behind the storage seam: `hf://` paths read, models published.

Every request is `huggingface_hub`'s own. (It is an optional dependency,
imported here only, at the first Hub call.)

- A revision is resolved by `HfApi.model_info`.
- Whole files are downloaded into its cache by `hf_hub_download`.
- Byte ranges are read through its file system (`HfFileSystem`).
- A publication is committed by `HfApi.create_commit`.

So authentication (`HF_TOKEN`, `hf auth login`), the cache (`HF_HOME`),
offline mode (`HF_HUB_OFFLINE`), retries and the Xet transfer path are the
library's.

A repository is read at one commit. A branch or a tag is resolved to its
commit once, when it is opened (`pin`). Every file is then read at that
commit, which no later push changes. Only the files a load needs are ever
fetched: safetensors files, their index, `eqx_ckpt.json`, the model card. No
Python file, pickle or configuration of a repository is downloaded, let alone
run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .._base._errors import (
    CheckpointConnectionError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointTypeError,
    from_file,
)
from .._base._location import Location, hub_location
from .._ondisk._format import PUBLISHED
from .._ondisk._manifest import loads_file

INSTALL = 'pip install "eqx_ckpt[hub]"'
# The files of a folder a load may read; nothing else is downloaded or read.
INDEX_SUFFIX = ".safetensors.index.json"
SUFFIX = ".safetensors"
RECORD = PUBLISHED
CARD = "README.md"
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
# What a file that is code, or that unpickling would run code from, is called
# when a repository holds no model eqx_ckpt reads.
_CODE = (".py",)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5", ".npz", ".joblib")


def library() -> Any:
    """`huggingface_hub`, imported at the first Hub call (never by `import eqx_ckpt`)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
    except ImportError:
        raise ImportError(
            f"Reading from or publishing to the Hugging Face Hub needs `huggingface_hub`, an optional dependency "
            f"of eqx_ckpt: install it with `{INSTALL}` (in a checkout, `pip install -c constraints.txt -e "
            f'".[hub]"`).'
        ) from None
    return huggingface_hub


@dataclasses.dataclass(frozen=True)
class Pinned:
    """A repository's folder at one commit.

    **Attributes:**

    - `repo`: `owner/name`.
    - `asked`: the revision as the user named it (`None`: the default branch).
    - `sha`: the commit it resolved to.
    - `folder`: the folder within the repository (`""`, or `"sub/folder/"`).
    - `sizes`: every file of the repository at `sha`, by path, with its size in bytes.
    - `offline`: whether the commit and the files were found in the local cache only.
    """

    repo: str
    asked: str | None
    sha: str
    folder: str
    sizes: dict[str, int]
    offline: bool

    @property
    def display(self) -> str:
        return f"hf://{self.repo}@{self.sha}" + (f"/{self.folder.rstrip('/')}" if self.folder else "")

    def files(self) -> dict[str, int]:
        """The files directly in the folder, by name, with their sizes."""
        n = len(self.folder)
        return {p[n:]: s for p, s in self.sizes.items() if p.startswith(self.folder) and "/" not in p[n:]}


# The pinned folders opened in this process, by (repo, commit, folder): what
# `Folder` reads of a `hf://` location (its `revision` a commit).
_OPENED: dict[tuple[str, str, str], Pinned] = {}
_LOCK = threading.Lock()
# Small files read whole (an index, `eqx_ckpt.json`), by (repo, commit, path): a
# commit's files never change, and an opened folder reads its index twice.
_SMALL: dict[tuple[str, str, str], bytes] = {}
SMALL_BYTES = 2**20


def is_hub(loc: Location) -> bool:
    return loc.kvstore.get("driver") == "hf"


def pin(loc: Location) -> Pinned:
    """Resolve the revision of a `hf://` location to its commit, once, and list
    the repository's files there.

    Where the Hub cannot be reached or `HF_HUB_OFFLINE` is set, both come from
    the local cache, as the Hugging Face libraries do."""
    hub = library()
    repo, asked, folder = loc.kvstore["repo"], loc.kvstore["revision"], loc.kvstore["path"]
    if not hub.constants.HF_HUB_OFFLINE:
        try:
            info = _model_info(hub, repo, asked)
        except Exception as e:
            if not _unreachable(e):
                raise explained(e, repo, asked) from None
        else:
            sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
            return _remember(Pinned(repo, asked, str(info.sha), folder, sizes, offline=False))
    return _remember(_from_cache(loc, hub))


def _model_info(hub: Any, repo: str, revision: str | None) -> Any:
    """`HfApi.model_info` of the revision, asked again (`TRIES` in all) while the
    Hub answers that it is rate limited or failed (429, 5xx)."""
    for attempt in range(TRIES):
        try:
            return hub.HfApi().model_info(repo, revision=revision, files_metadata=True)
        except Exception as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            if status not in _RETRIED or attempt == TRIES - 1:
                raise
        time.sleep(RETRY_SECONDS * 2**attempt)
    raise AssertionError("unreachable")  # (every try returns or raises)


def _remember(pinned: Pinned) -> Pinned:
    with _LOCK:
        _OPENED[(pinned.repo, pinned.sha, pinned.folder)] = pinned
    return pinned


def _from_cache(loc: Location, hub: Any) -> Pinned:
    """The commit a revision resolved to when the repository was last fetched,
    and the files cached at it (the Hub could not be asked)."""
    repo, asked, folder = loc.kvstore["repo"], loc.kvstore["revision"], loc.kvstore["path"]
    root = os.path.join(hub.constants.HF_HUB_CACHE, hub.file_download.repo_folder_name(repo_id=repo, repo_type="model"))
    sha = asked if asked is not None and re.fullmatch(r"[0-9a-f]{40}", asked) else None
    if sha is None:
        try:
            with open(os.path.join(root, "refs", *(asked or hub.constants.DEFAULT_REVISION).split("/"))) as f:
                sha = f.read().strip()
        except OSError:
            sha = None
    snapshot = os.path.join(root, "snapshots", sha or "-")
    if sha is None or not os.path.isdir(os.path.join(snapshot, folder)):
        why = "offline mode is on (`HF_HUB_OFFLINE=1`)" if hub.constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise CheckpointConnectionError(
            f"hf://{repo}@{asked or 'main'}: {why}, and the local cache ({hub.constants.HF_HUB_CACHE}) holds no "
            f"copy of it. Connect once to fetch it (a whole load keeps it in the cache; `HF_HOME` chooses where), "
            f"then it loads without a network, with `HF_HUB_OFFLINE=1` too.",
            path=f"hf://{repo}",
        )
    sizes = {}
    for base, _, names in os.walk(snapshot):
        for name in names:
            path = os.path.join(base, name)
            sizes[os.path.relpath(path, snapshot).replace(os.sep, "/")] = os.path.getsize(path)
    return Pinned(repo, asked, sha, folder, sizes, offline=True)


def _unreachable(error: BaseException) -> bool:
    """Whether `error` says the Hub could not be reached (not that it answered no)."""
    hub = library()
    if isinstance(error, hub.errors.OfflineModeIsEnabled):
        return True
    try:
        import httpx2

        return isinstance(error, (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.ReadTimeout))
    except ImportError:  # an older huggingface_hub, on httpx or requests
        return isinstance(error, (ConnectionError, TimeoutError))


def explained(error: BaseException, repo: str, revision: str | None) -> Exception:
    """`huggingface_hub`'s error as one of eqx_ckpt's, naming the repository and revision."""
    hub = library()
    where = f"hf://{repo}@{revision or 'main'}"
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, hub.errors.RevisionNotFoundError):
        return CheckpointNotFoundError(
            f"{where}: the repository has no revision {revision!r} (a branch, a tag or a commit). Check the name; "
            f"`huggingface_hub.list_repo_refs({repo!r})` lists its branches and tags.",
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


def _token_said() -> str:
    return "one was given" if library().get_token() is not None else "none was given"


def _first_line(error: BaseException) -> str:
    """The first line of `error`, and of what caused it (huggingface_hub wraps a failed upload)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    said = f"{type(error).__name__}: {from_file(lines[0]) if lines else ''}".strip()  # (a server's words)
    cause = error.__cause__
    return said + (f", caused by {_first_line(cause)}" if cause is not None and cause is not error else "")


def needed(pinned: Pinned, read_index: Callable[[str], bytes]) -> list[str]:
    """The files of the pinned folder a load reads.

    They are the safetensors files (an index and its shards, or one file), and
    `eqx_ckpt.json` and the model card where they are there. A folder holding
    no safetensors file raises, saying what it holds."""
    files = pinned.files()
    indexes = sorted(n for n in files if n.endswith(INDEX_SUFFIX))
    singles = sorted(n for n in files if n.endswith(SUFFIX))
    extras = [n for n in (RECORD, CARD) if n in files]
    if indexes:
        index = "model" + INDEX_SUFFIX if "model" + INDEX_SUFFIX in indexes else indexes[0]
        shards = _shards(pinned, read_index(index))
        return [index, *shards, *extras]
    if singles:
        return ["model" + SUFFIX if "model" + SUFFIX in singles else singles[0], *extras]
    raise CheckpointNotFoundError(_holds_nothing(pinned), path=pinned.display)


def _shards(pinned: Pinned, data: bytes) -> list[str]:
    """The shards an index names (a name that is no file of the folder is left
    for the safetensors reader to refuse, with its reason)."""
    try:
        weight_map = loads_file(data).get("weight_map", {})
        names = {v for v in weight_map.values() if isinstance(v, str)}
    except (ValueError, AttributeError):
        return []
    return sorted(n for n in names if n in pinned.files())


def _holds_nothing(pinned: Pinned) -> str:
    files = sorted(pinned.files())
    code = [n for n in files if n.endswith(_CODE)]
    pickles = [n for n in files if n.endswith(_PICKLES)]
    held = []
    if pickles:
        held.append(f"pickled or framework weights ({_shown(pickles)}), which eqx_ckpt never reads")
    if code:
        held.append(f"Python code ({_shown(code)}), which eqx_ckpt never runs")
    rest = [n for n in files if n not in code and n not in pickles]
    if rest:
        held.append(f"other files ({_shown(rest)})")
    folders = sorted(
        {p[len(pinned.folder) :].split("/")[0] for p in pinned.sizes if p.startswith(pinned.folder)} - set(files)
    )
    if folders:
        held.append(f"folders ({_shown(folders)}; name one as `hf://{pinned.repo}@{pinned.sha}/<folder>`)")
    holds = "; ".join(held) if held else "no files"
    return (
        f"{pinned.display} holds no model eqx_ckpt reads (no `*{SUFFIX}` file, no `*{INDEX_SUFFIX}`): it holds "
        f"{holds}. eqx_ckpt loads safetensors weights, with `{RECORD}` for the structure where there is one."
    )


def _shown(names: list[str]) -> str:
    listed = ", ".join(f"`{from_file(n)}`" for n in names[:5])
    return listed + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def reader(pinned: Pinned, *, whole: bool) -> Callable[[str], bytes]:
    """How `needed` reads an index.

    For a whole load it is downloaded into the cache, and read there. So is
    one already in the cache. Else it is read by one read through the Hub's
    file system."""

    def read(name: str) -> bytes:
        if whole or pinned.offline or cached(pinned, [name]):
            with open(os.path.join(download(pinned, [name]), name), "rb") as f:
                return f.read(MAX_INDEX + 1)
        data, _ = Files(pinned_location(pinned)).read(name).result()
        return data or b""

    return read


def cached(pinned: Pinned, names: Iterable[str]) -> bool:
    """Whether every one of `names` is in the local cache at the pinned commit."""
    hub = library()
    return all(
        isinstance(hub.try_to_load_from_cache(pinned.repo, pinned.folder + n, revision=pinned.sha), str) for n in names
    )


def download(pinned: Pinned, names: list[str]) -> str:
    """Download `names` of the pinned folder into the Hub's local cache, and
    return the local folder holding them.

    Those already there are not fetched again. Each is checked against the
    size the Hub listed."""
    hub = library()
    fetch = functools.partial(_download_one, hub, pinned)
    with concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="eqx_ckpt-hub") as pool:
        paths = list(pool.map(fetch, names))
    for name, path in zip(names, paths):
        expected = pinned.sizes.get(pinned.folder + name)
        if expected is not None and os.path.getsize(path) != expected:
            from .._base._errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"{pinned.display}: `{name}` was downloaded as {os.path.getsize(path)} bytes, but the Hub lists "
                f"{expected}. The download or the cache is damaged: delete the file from the cache "
                f"(`hf cache rm`) and load again.",
                path=pinned.display,
            )
    _remember_ref(hub, pinned)
    return os.path.dirname(paths[0]) if paths else ""


def _remember_ref(hub: Any, pinned: Pinned) -> None:
    """Record in the cache which commit the branch or tag resolved to, as
    huggingface_hub's downloads by branch do (`refs/<revision>`).

    An offline load of the same revision resolves it to that commit. (The
    files were downloaded by commit, which records none.)"""
    revision = pinned.asked or hub.constants.DEFAULT_REVISION
    if pinned.offline or revision == pinned.sha:
        return
    root = os.path.join(
        hub.constants.HF_HUB_CACHE, hub.file_download.repo_folder_name(repo_id=pinned.repo, repo_type="model")
    )
    ref = os.path.join(root, "refs", *revision.split("/"))
    os.makedirs(os.path.dirname(ref), exist_ok=True)
    partial = f"{ref}.{os.getpid()}.{threading.get_ident()}.partial"
    with open(partial, "w") as f:
        f.write(pinned.sha)
    os.replace(partial, ref)


def _download_one(hub: Any, pinned: Pinned, name: str) -> str:
    try:
        return str(
            hub.hf_hub_download(pinned.repo, pinned.folder + name, revision=pinned.sha, local_files_only=pinned.offline)
        )
    except Exception as e:
        raise explained(e, pinned.repo, pinned.asked) from None


def local_location(pinned: Pinned, folder: str) -> Location:
    """The cached copy of a pinned folder, as a local directory named in messages as the Hub's."""
    return Location({"driver": "file", "path": folder.rstrip("/") + "/"}, pinned.display, folder.rstrip("/"))


def pinned_location(pinned: Pinned) -> Location:
    """The `hf://` location of a pinned folder: its revision is the commit."""
    return hub_location(pinned.repo, pinned.sha, pinned.folder, pinned.display)


class Files:
    """The files of a pinned folder, read by byte ranges through
    `huggingface_hub`'s file system (`HfFileSystem`) at the commit: the
    `_storage.Folder` of a `hf://` location."""

    def __init__(self, loc: Location):
        key = (loc.kvstore["repo"], loc.kvstore["revision"], loc.kvstore["path"])
        with _LOCK:
            pinned = _OPENED.get(key)
        self.pinned = pinned if pinned is not None else pin(loc)
        self.fs = library().HfFileSystem()

    def read(self, name: str, byte_range: slice | None = None) -> concurrent.futures.Future:
        """A future of `(bytes or None, generation)`; a range starting past the
        end of the file fails with `OUT_OF_RANGE`, as TensorStore's reads do."""
        return _pool().submit(self._read, name, byte_range)

    def _read(self, name: str, byte_range: slice | None) -> tuple[bytes | None, bytes]:
        key = (self.pinned.repo, self.pinned.sha, self.pinned.folder + name)
        if byte_range is None and key in _SMALL:  # an index read again, as the folder is opened
            return _SMALL[key], self.pinned.sha.encode()
        data, generation = self._fetch(name, byte_range)
        if byte_range is None and data is not None and len(data) <= SMALL_BYTES:
            with _LOCK:
                if len(_SMALL) >= 256:  # bounded: a long process opening many repositories
                    _SMALL.clear()
                _SMALL[key] = data
        return data, generation

    def _fetch(self, name: str, byte_range: slice | None) -> tuple[bytes | None, bytes]:
        generation = self.pinned.sha.encode()
        size = self.pinned.sizes.get(self.pinned.folder + name)
        if size is None:
            return None, b""
        start = 0 if byte_range is None else byte_range.start or 0
        stop = size if byte_range is None or byte_range.stop is None else min(byte_range.stop, size)
        if start > size:
            raise OSError(f"OUT_OF_RANGE: bytes {start}.. of `{name}`, which has {size}")
        if stop <= start:
            return b"", generation
        path = f"{self.pinned.repo}@{self.pinned.sha}/{self.pinned.folder}{name}"
        try:
            with self.fs.open(path, "rb", block_size=max(stop - start, 1), cache_type="none") as f:
                f.seek(start)
                data = f.read(stop - start)
        except Exception as e:
            raise explained(e, self.pinned.repo, self.pinned.asked) from None
        return bytes(data), generation


def read_small(
    loc: Location, name: str, *, limit: int, too_large: Callable[..., Exception]
) -> tuple[bytes | None, bytes]:
    """A small file of a pinned folder (`eqx_ckpt.json`), or `None`; one the Hub
    lists larger than `limit` is refused before it is read."""
    files = Files(loc)
    size = files.pinned.sizes.get(files.pinned.folder + name)
    if size is not None and size > limit:
        raise too_large(loc, name, limit, size)
    data, generation = files.read(name).result()
    if data is not None and len(data) > limit:
        raise too_large(loc, name, limit, len(data))
    return data, generation


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(THREADS * 2, thread_name_prefix="eqx_ckpt-hub-read")


def publish(
    write: Callable[[str], list[str]],
    repo: str,
    *,
    token: str | None,
    private: bool,
    revision: str | None,
    commit_message: str,
) -> str:
    """Write the files of a publication into a temporary folder, then commit
    them to `repo` in one commit. Returns the commit's id.

    - `write(folder)` writes the files and returns their names.
    - The repository is made first where there is none.
    - A branch named by `revision` is made from the default branch where there
      is none."""
    hub = library()
    api = hub.HfApi(token=token)
    where = f"hf://{repo}@{revision or 'main'}"
    with tempfile.TemporaryDirectory(prefix="eqx_ckpt-push-") as folder:
        names = write(folder)
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            if revision is not None:
                api.create_branch(repo, branch=revision, exist_ok=True)
            operations = [hub.CommitOperationAdd(name, os.path.join(folder, name)) for name in names]
            with warnings.catch_warnings():
                # huggingface_hub's LFS upload (where the Hub offers no Xet) hands
                # httpx2 bytes as `data=`, which httpx2 deprecates: the library's
                # own call, which nothing here can change.
                warnings.filterwarnings("ignore", "Use 'content=<...>'", DeprecationWarning)
                info = api.create_commit(repo, operations, commit_message=commit_message, revision=revision)
        except Exception as e:
            if isinstance(e, CheckpointTypeError):
                raise
            raise explained(e, repo, revision) from None
    commit = str(info.oid)
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise CheckpointStorageError(f"{where}: the Hub answered the commit with no commit id ({commit!r}).")
    return commit
