"""`verify`: read and check every byte of a checkpoint, chunk by chunk, so in
bounded memory whatever its size (or the absurd shape a hostile one claims).

A leaf's chunks are read by `_read_every_chunk` (in reads `_read.scan_chunks`
bounds), a pack's by `_pack.read_chunks`, each by `_read.start_region`. Other
formats are checked for what they can be: opening one checks its metadata,
then every chunk is read; they store no checksums (`unchecked` says so). A
published leaf whose digest the record keeps is read whole and its digest
compared; a fine-tune's leaves taken from its base are read from the base, at
its pin (docs/interop.md, docs/sharing.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from .._base import _state
from .._base._errors import (
    CheckpointError,
    CheckpointStorageError,
    CheckpointValueError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IntegrityError,
    LeafError,
    UntrustedError,
    shown_names,
)
from .._base._location import Location, location
from .._base._progress import Progress, Tracker
from .._foreign import _orbax, _safetensors
from .._load import _pack, _read
from .._load._load_plan import LoadOptions
from .._manage._steps import committed_steps
from .._ondisk import _digests, _format, _iterators, _layout, _manifest, _published
from .._ondisk._format import MANIFEST, LeafRecord, PackRecord, dtype_from_name, step_name
from .._ondisk._manifest import Manifest
from .._sources import _opening, _source, _verified
from .._store import _chunk_files, _storage, _storage_errors, _untrusted

# Pack chunks read at once.
_PACK_READS = 16

# Metadata keys that do not change how the bytes are read.
_FREE_KEYS = frozenset({"attributes", "dimension_names"})
_MAX_ZARR_JSON = 2**20
# Characters of an unexpected metadata value shown in a problem.
_SHOWN = 200


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, found by [`eqx_ckpt.verify`][].

    **Attributes:**

    - `leaf`: the dotted path of the damaged leaf, or `None` for the checkpoint as
        a whole (its manifest, or the zarr group metadata of one of its folders,
        which the message names).
    - `message`: what is wrong, in a full sentence.
    - `step`: in a `CheckpointManager`'s directory, the step it belongs to;
        `None` for a single checkpoint.
    - `file`: the chunk file found damaged, on a local disk, where it is
        known; else `None`. Steps share unchanged chunk files (incremental
        saves), and so do the leaves of a pack: one damaged file is a problem
        of each leaf, in each step, that uses it (the result's
        `damaged_files()` groups them).

    !!! example

        ```python
        import os
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(3)})
        os.remove("ckpt/packed.float32/c/0")    # a lost chunk of the small float32 leaves
        for problem in eqx_ckpt.verify("ckpt"):
            print(problem.leaf, problem.message)   # w ...
        ```
    """

    leaf: str | None
    message: str
    step: int | None = None
    file: str | None = None

    def __str__(self) -> str:
        text = self.message if self.leaf is None else f"{self.leaf or '<root>'}: {self.message}"
        return text if self.step is None else f"step {self.step}: {text}"


class Problems(list[Problem]):
    """What [`eqx_ckpt.verify`][] returns: a list of [`eqx_ckpt.Problem`][]s,
    empty when the checkpoint is sound, with `unchecked` and `steps` as its
    docstring says; `checked`, what was checked beyond the format (a Hub
    repository's files, by digest); `newer`, a manager's steps of a newer
    format (not damage). `damaged_files()` gives the root causes."""

    def __init__(
        self,
        problems: Iterable[Problem] = (),
        unchecked: tuple[str, ...] = (),
        steps: tuple[int, ...] = (),
        newer: tuple[int, ...] = (),
        *,
        checked: tuple[str, ...] = (),
    ):
        super().__init__(problems)
        self.unchecked = unchecked
        self.checked = checked
        self.steps = steps
        self.newer = newer

    def damaged_files(self) -> list[tuple[str, list[Problem]]]:
        """The damaged chunk files (one file under several names is one), each
        with the problems it causes in every step, most problems first."""
        groups: dict[Any, tuple[str, list[Problem]]] = {}
        for problem in self:
            if problem.file is not None:  # one file under several names (hard links) is one
                identity = _storage.local_entry(problem.file).identity or problem.file
                groups.setdefault(identity, (problem.file, []))[1].append(problem)
        return sorted(groups.values(), key=lambda group: -len(group[1]))


# Where a local read's error names the file it read.
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')


def verify(path: Any, *, progress: Progress = None, token: str | None = None, base: Any = None) -> Problems:
    """Read and check every byte of a checkpoint.

    It checks:

    - the manifest: its digest, its schema, its totals;
    - every leaf's `zarr.json` against the manifest;
    - the zarr group metadata of the folders above the leaves (which zarr
        tools need, though loads do not);
    - every chunk of every leaf against its crc32c checksum.

    A chunk file that is missing, truncated or altered is a problem, and so
    are a symlink inside the checkpoint and edited metadata. Nothing is loaded
    onto a device, and memory use stays bounded whatever the size.

    A `CheckpointManager`'s directory is verified step by step: every
    committed step, in order (a step deleted meanwhile by the retention of a
    run still saving there is left out, and `unchecked` says so).

    A safetensors file, a Hugging Face directory or an orbax checkpoint is
    checked for its headers or metadata (offsets in bounds, one after another,
    the file's size, the index's shards and tensors), and that every tensor's
    bytes (every chunk) are there and read. These formats hold no checksums, so
    a changed byte cannot be detected: the result's `unchecked` says so. A Hub
    repository (`hf://`) is downloaded into the Hub's cache, and every file is
    checked against the SHA-256 (or git blob id) the Hub lists for it at the
    pinned commit.

    **Arguments:**

    - `path`: the checkpoint directory, or a kvstore URL; a `CheckpointManager`'s
        directory; or a `.safetensors` file, a Hugging Face directory of them,
        or an orbax checkpoint.
    - `progress`: by default a progress bar (bytes and leaves) shows on stderr
        when it is a terminal and the checkpoint is large. `False` hides it,
        `True` shows it whatever the size, and a callable is called as
        `progress(leaves_done, leaves_total, bytes_done, bytes_total)`.
    - `token`: a Hugging Face Hub token, for an `hf://` path of a private or
        gated repository; `None` takes `HF_TOKEN` or the one `hf auth login` saved.
    - `base`: for a fine-tune stored against a base, where its base is, where
        its record's is not followed on its own (as [`eqx_ckpt.Checkpoint`][]'s
        `base`).

    **Returns:**

    A list of [`eqx_ckpt.Problem`][]s, empty when the checkpoint is sound. Each
    names the damaged leaf by its dotted path (problems of the manifest and of
    group metadata, which belong to no leaf, come first). Its attribute
    `unchecked` lists, in sentences, what was not checked (what the format
    cannot be checked for; empty for eqx_ckpt's own checkpoints). Of a
    manager's directory, each problem's `step` names its step, and the
    attribute `steps` lists the steps verified (for a single checkpoint, `()`).

    **Raises:**

    - [`eqx_ckpt.CheckpointNotFoundError`][] if there is no checkpoint of any
        format at `path` (saying what is there).
    - [`eqx_ckpt.CheckpointVersionError`][] if it was written in a newer
        format than this eqx_ckpt reads (nothing is wrong with it: upgrade).
        Of a manager's directory, such steps are listed in `newer` instead.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(3)})
        assert eqx_ckpt.verify("ckpt") == []
        ```
    """
    loc = location(path)
    try:
        # A Hub repository holds no eqx_ckpt checkpoint directory, only the published layout.
        foreign = _safetensors.is_file_path(loc) or loc.hub is not None
        source = None if foreign else _source.checkpoint(loc)
    except CorruptCheckpointError as e:
        return Problems([Problem(None, str(e))])
    if base is not None and (source is not None or (not foreign and committed_steps(loc))):
        raise CheckpointValueError(
            f"`base` was given, but {loc.display!r} is not a fine-tune stored against a base: it holds every leaf "
            f"itself. Verify it without `base`."
        )
    if source is None:
        steps = [] if foreign else committed_steps(loc)
        if steps:
            return _verify_steps(loc, steps, progress)
        return _check_foreign(loc, progress, token, base)
    manifest = source.manifest
    with Tracker(progress, leaves=len(manifest.leaves), nbytes=manifest.total_bytes, what="verify") as tracker:
        return Problems(_check(source, tracker))


def _check(source: _source.Source, tracker: Tracker) -> list[Problem]:
    """The problems of the eqx_ckpt checkpoint `source`: its manifest's
    totals, its groups, its packs, then its leaves, by dotted path."""
    manifest, data = source.manifest, source.data
    problems = _check_totals(source.loc, manifest)
    records = sorted(manifest.leaves, key=lambda r: r.path)
    problems += _check_groups(data, manifest)
    bad = _check_packs(data, manifest, tracker)
    bad |= _check_leaves(data, [r for r in records if r.pack is None], tracker)
    return problems + [bad[r.path] for r in records if r.path in bad] + _check_iterators(source.loc, manifest)


def _check_iterators(loc: Location, manifest: Manifest) -> list[Problem]:
    """The problems of the manifest's iterator states: each decoded, bounded
    and its digest matched, as a load checks it before `set_state`."""
    problems = []
    for record in manifest.iterators:
        for process, state in enumerate(record.states):
            try:
                _iterators.check_state(state, record.path, checkpoint=loc.display, loads=_manifest.loads_file)
            except LeafError as e:
                problems.append(Problem(record.path, f"the state of process {process}: {e}"))
    return problems


def _verify_steps(loc: Location, steps: list[int], progress: Progress) -> Problems:
    """Every committed step of a manager's directory, in order, under one
    progress bar; a step deleted meanwhile (by retention) is left out, and `unchecked` says so."""
    opened: dict[int, _source.Source | Problem] = {}
    gone: list[int] = []
    newer: dict[int, str] = {}
    for step in steps:
        try:
            source = _source.checkpoint(loc.joined(step_name(step)))
        except CorruptCheckpointError as e:
            opened[step] = Problem(None, str(e), step)
            continue
        except CheckpointVersionError as e:
            newer[step] = str(e)  # not damage: an older eqx_ckpt cannot check it
            continue
        if source is None:
            gone.append(step)
        else:
            opened[step] = source
    manifests = [s.manifest for s in opened.values() if isinstance(s, _source.Source)]
    leaves, nbytes = sum(len(m.leaves) for m in manifests), sum(m.total_bytes for m in manifests)
    problems: list[Problem] = []
    with Tracker(progress, leaves=leaves, nbytes=nbytes, what="verify") as tracker:
        for step, opened_step in opened.items():
            here = loc.joined(step_name(step))
            found = [opened_step] if isinstance(opened_step, Problem) else _check(opened_step, tracker)
            if found and not _storage.file_exists(here, MANIFEST):
                gone.append(step)  # deleted while it was read: its missing files are no damage
                continue
            problems += [dataclasses.replace(problem, step=step) for problem in found]
    unchecked = tuple(
        f"Step {step} was deleted while it was verified (by the retention of the manager saving there), so it "
        f"is not reported on."
        for step in sorted(gone)
    )
    unchecked += tuple(f"Step {step} was not checked: {why}" for step, why in newer.items())
    verified = tuple(step for step in steps if step not in gone and step not in newer)
    return Problems(problems, unchecked, steps=verified, newer=tuple(newer))


def _check_totals(loc: Location, manifest: Manifest) -> list[Problem]:
    """The redundant counts in the manifest, as its one parse kept them
    (`Manifest.declared`), must agree with its leaf records."""
    declared = manifest.declared
    if declared is None:  # made in memory, not read: its totals are its leaves'
        return []
    problems = []
    if declared.leaf_count != len(manifest.leaves) or declared.total_bytes != manifest.total_bytes:
        problems.append(Problem(None, f"The manifest of {loc.display!r} gives totals that disagree with its leaves."))
    for i, given in declared.nbytes.items():
        record = manifest.leaves[i]
        if given != record.nbytes:
            problems.append(Problem(record.path, f"the manifest gives {given!r} bytes, not {record.nbytes}."))
    return problems


def _check_packs(data: Location, manifest: Manifest, tracker: Tracker) -> dict[str, Problem]:
    """Every pack, chunk by chunk; a damaged chunk is a problem of each leaf in it."""
    bad: dict[str, Problem] = {}
    groups = _pack.by_pack(manifest.leaves)
    for pack in manifest.packs:
        members = sorted((manifest.leaves[i] for i in groups.get(pack.name, [])), key=lambda r: r.offset)
        problem = _check_metadata(data, pack.name, (pack.size,), pack.dtype, (pack.chunk,), pack.compression)
        chunk_nbytes = pack.chunk * dtype_from_name(pack.dtype).itemsize
        grid = ((pack.size,), (pack.chunk,))
        problem = problem or _check_file_sizes(data, pack.name, *grid, chunk_nbytes, pack.compression)
        damaged: dict[int, str] = {}
        if problem is None:
            try:
                damaged = _read_pack(data, pack, members)
            except CheckpointStorageError:
                raise
            except CheckpointError as e:
                problem = str(e)
            except Exception as e:
                problem = str(_damage(e, members[0], data, "open")) if members else str(e)
        for record in members:
            chunks = range(record.offset // pack.chunk, -(-(record.offset + record.size) // pack.chunk))
            k = next((k for k in chunks if k in damaged), None)
            why = problem or (damaged[k] if k is not None else None)
            if why is not None:
                file = None
                if k is not None and data.local is not None:
                    file = os.path.join(data.local, pack.name, *_format.chunk_key((k,)).split("/"))
                bad[record.path] = Problem(record.path, f"its pack {pack.name!r} is damaged: {why}", file=file)
        tracker.count_leaves([r.nbytes for r in members])
    return bad


def _read_pack(data: Location, pack: PackRecord, members: list[LeafRecord]) -> dict[int, str]:
    """Read every chunk of a pack, a few at a time, by the pack reader
    (`_pack.read_chunks`: each chunk a run of its own); what is wrong, by chunk."""
    damaged: dict[int, str] = {}
    for k, finish in _pack.read_chunks(data, pack, members, max_reads=_PACK_READS):
        try:
            finish()
        except Exception as e:
            refused = _storage_errors.storage_failure(data, e, f"pack {pack.name!r}")
            if refused is not None:
                raise refused from None
            damaged[k] = _storage_errors.explain(e)
    if damaged:
        _chunk_files.chunk_files(data).forget(pack.name)
    return damaged


def _check_leaves(data: Location, records: list[LeafRecord], tracker: Tracker) -> dict[str, Problem]:
    bad: dict[str, Problem] = {}
    for record in records:
        shape, dtype, chunks = record.stored_shape, record.stored_dtype, record.chunks
        why = _check_metadata(data, record.directory, shape, dtype, chunks, record.compression)
        if why is not None:
            bad[record.path] = Problem(record.path, why)
    _read_every_chunk(data, records, lambda record: _storage.open_array(data, record), tracker, bad)
    for record in records:
        if record.path not in bad:
            shape, chunks, compression = record.stored_shape, record.chunks, record.compression
            why = _check_file_sizes(data, record.directory, shape, chunks, record.chunk_nbytes, compression)
            if why is not None:
                bad[record.path] = Problem(record.path, why)
    return bad


def _read_every_chunk(
    data: Location, records: list[LeafRecord], open_store: _source.Opener, tracker: Tracker, bad: dict[str, Problem]
) -> None:
    """Open each of `records` not in `bad` yet and read every chunk of it. A
    leaf stops at its first failure to open or read, its problem in `bad`."""
    stores: dict[str, Any] = {}
    for record in records:
        if record.path not in bad:
            try:
                stores[record.path] = open_store(record).result()
            except Exception as e:
                bad[record.path] = Problem(record.path, str(_damage(e, record, data, "open")))

    def failed(record: LeafRecord, error: BaseException) -> None:
        message = str(_damage(error, record, data, "read"))
        named = _LOCAL_FILE.search(str(error))
        bad.setdefault(record.path, Problem(record.path, message, file=named.group(1) if named else None))

    def stop(path: str) -> Callable[[], bool]:
        return lambda: path in bad

    jobs = (
        (r, stores[r.path], i) for r in records if r.path in stores for i in _read.chunk_indices(r, stop=stop(r.path))
    )
    count = _read.LeafCounter(records, tracker)
    read = lambda record, store, index: _read.start_region(store, data, record, index, raw=True)
    for record, _, size in _read.scan_chunks(jobs, skip=lambda r: r.path in bad, failed=failed, read=read):
        count(record, size)


def _damage(error: BaseException, record: LeafRecord, data: Location, doing: str) -> CheckpointError:
    """What a failure to `doing` a leaf says of the checkpoint; raised instead
    when the storage would not serve it, which says nothing about the checkpoint."""
    explained = _storage_errors.leaf_io_error(error, record, data, doing)
    if isinstance(explained, CheckpointStorageError):
        raise explained from None
    _chunk_files.chunk_files(data).forget_damaged(explained, record)
    return explained


def _check_file_sizes(
    data: Location,
    directory: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    chunk_nbytes: int,
    compression: str = "",
) -> str | None:
    """Every local chunk file is there and holds exactly one full chunk and its
    checksum (a compressed one: at most that), as a load words it: TensorStore
    ignores bytes appended after the checksum, so reads alone would not notice."""
    if data.local is None:
        return None
    why = _untrusted.first_wrong_chunk_file(data, directory, shape, chunks, chunk_nbytes, compression)
    if why is not None:
        return why + "."
    chunks_at = data.joined(f"{directory}/{_format.CHUNKS}")
    folder = chunks_at.local or ""
    one = _storage.local_entry(folder).file
    files = [folder] if one else [os.path.join(folder, name) for name in _storage.list_files(chunks_at)]
    for file in files:
        entry = _storage.local_entry(file)
        if entry.link and not entry.file:
            continue  # a link to a folder, or to nothing: the read that follows refuses it, naming the link
        why = _untrusted.wrong_size(os.path.relpath(file, data.local), entry.size, chunk_nbytes, compression)
        if why is not None:
            return why + "."
    return None


def _check_metadata(
    data: Location, directory: str, shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...], compression: str
) -> str | None:
    """An array's `zarr.json` must be exactly what eqx_ckpt writes for it."""
    actual, why = _read_object(data, _format.metadata_key(directory), "its zarr.json")
    if actual is None:
        return why
    expected = _reference_metadata(shape, dtype, chunks, compression)
    differ = sorted(k for k in (set(actual) | set(expected)) - _FREE_KEYS if actual.get(k) != expected.get(k))
    if differ:
        shown = ", ".join(f"{k}: {_brief(actual.get(k))} instead of {expected.get(k)!r}" for k in differ)
        return f"its zarr.json disagrees with the manifest ({shown})."
    return None


def _check_groups(data: Location, manifest: Manifest) -> list[Problem]:
    """The `zarr.json` of every group a save of the manifest's leaves writes
    (`_layout.groups`). Loads never read them, but zarr tools walking the
    checkpoint's folders do, and refuse a missing or broken one."""
    # The first version that packed leaves (format 3) wrote no root group beside
    # packs when no leaf had a folder of its own: its absence is no problem there.
    optional = manifest.format_version == 3 and all(r.pack is not None or not r.path for r in manifest.leaves)
    problems = []
    for folder in _layout.groups(manifest.leaves):
        key = _format.metadata_key(folder)
        what = f"The zarr group metadata {key!r}"
        actual, why = _read_object(data, key, what, optional=optional and folder == "")
        if actual is not None:
            why = _group_differs(actual, what)
        if why is not None:
            fix = f"restore it from a good copy, or write {_format.GROUP_JSON.decode()} in its place"
            problems.append(Problem(None, f"{why} Loads do not read it, but zarr tools do: {fix}."))
    return problems


def _group_differs(actual: dict[str, Any], what: str) -> str | None:
    """How a group's `zarr.json` differs from what a save writes (`_format.GROUP`).
    A user's zarr tool may add what leaves it the same group to every zarr
    reader: `attributes` (xarray annotates groups), or an extension field
    marked `"must_understand": false` (zarr-python's consolidated metadata)."""
    differ = []
    for name in sorted(set(actual) | set(_format.GROUP)):
        value, expected = actual.get(name), _format.GROUP.get(name)
        if name == "attributes":
            if name in actual and not isinstance(value, dict):
                differ.append(f"attributes: {_brief(value)}, not a JSON object")
        elif name not in _format.GROUP:
            if not (isinstance(value, dict) and value.get("must_understand") is False):
                differ.append(f"{name}: {_brief(value)}, a field no zarr reader knows")
        elif type(value) is not type(expected) or value != expected:
            differ.append(f"{name}: {_brief(value)} instead of {expected!r}")
    if not differ:
        return None
    return f"{what} is not the zarr v3 group eqx_ckpt writes ({', '.join(differ)})."


def _read_object(
    data: Location, key: str, what: str, *, optional: bool = False
) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object in the small metadata file `key`, or what is wrong with
    it, said of `what` (neither, when an `optional` file is missing): untrusted
    bytes, bounded before they are read, and a problem, never an error."""
    try:
        raw = _storage.read_file(data, key, limit=_MAX_ZARR_JSON)
    except CheckpointStorageError:
        raise
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:  # a damaged OCDBT database fails the read itself
        if (refused := _storage_errors.storage_failure(data, e, f"{key!r}")) is not None:
            raise refused from None
        return None, f"{what} could not be read: {_storage_errors.explain(e)}"
    if raw is None:
        return None, None if optional else f"{what} is missing from {data.display!r}."
    try:
        actual = _manifest.loads_file(raw)
    except ValueError:
        return None, f"{what} is not valid JSON."
    if not isinstance(actual, dict):
        return None, f"{what} is not a JSON object."
    return actual, None


def _brief(value: Any) -> str:
    """`repr(value)`, cut short: an edited file may hold a megabyte in one field."""
    shown = repr(value)
    return shown if len(shown) <= _SHOWN else shown[: _SHOWN - 3] + "..."


@_state.memo(256)
def _reference_metadata(
    shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...], compression: str
) -> dict[str, Any]:
    """The zarr.json TensorStore writes for such an array, made in memory."""
    # A scratch store of its own, so that verifies in several threads never
    # create, read or remove one another's reference array.
    scratch = location(f"memory://eqx_ckpt_verify_reference/{uuid.uuid4().hex}/")
    record = LeafRecord(
        "x", [["key", "x"]], "numpy", shape, dtype, shape, dtype, "plain", chunks, compression=compression
    )
    try:
        _storage.create_array(scratch, record).result()
        written = _storage.read_file(scratch, _format.metadata_key("x"), limit=_MAX_ZARR_JSON)
        return _manifest.loads_file(written or b"{}")
    finally:
        _storage.remove(scratch, ["x"])


# -- Other formats ---------------------------------------------------------------------------------

SAFETENSORS_UNCHECKED = (
    "Safetensors files hold no checksums: a changed byte inside a tensor cannot be detected. Checked: the "
    "headers (and the index), and that every tensor's bytes are there."
)
ORBAX_UNCHECKED = (
    "orbax stores no checksums of its arrays: a changed byte is detected only where it breaks a chunk's "
    "encoding. Checked: its _METADATA, every array's metadata, and that every chunk is there and decodes."
)
ORBAX_INCOMPLETE = (
    "This orbax checkpoint does not record that every chunk was written (older orbax leaves out chunks of "
    "zeros), so a missing chunk reads as zeros and cannot be told from one that was never written."
)


def _check_foreign(loc: Location, progress: Progress, token: str | None, base: Any) -> Problems:
    """`verify` of another format's checkpoint at `loc`: what could not be
    checked (`unchecked`), what was beyond the format (`checked`: a Hub
    repository's files, by digest). `base`: a fine-tune's base as given, or `None`."""
    hub = loc.hub is not None
    try:
        # A Hub repository is verified as the cache holds it: downloaded whole,
        # every file checked against the digest the Hub lists for it.
        source = _opening.open_source(loc, LoadOptions(token=token, base=base), whole=hub)
        missing = None if source.base is None else source.base.missing()
    except CorruptCheckpointError as e:
        return Problems([Problem(None, str(e))])
    records = sorted(source.manifest.leaves, key=lambda r: r.path)
    digests = source.manifest.digests
    # A fine-tune whose base cannot be reached: its own leaves are verified, those taken from the base are not.
    taken = set() if missing is None or source.base is None else set(source.base.references)
    bad: dict[str, Problem] = {}
    nbytes = sum(r.nbytes for r in records if r.path not in taken)
    with Tracker(progress, leaves=len(records) - len(taken), nbytes=nbytes, what="verify") as tracker:
        _read_every_chunk(source.data, [r for r in records if r.path not in digests], source.open, tracker, bad)
        compared = [r for r in records if r.path in digests and r.path not in taken]
        found, differ = _compare_digests(source, compared, tracker)
        bad.update(found)
    # (`file` names an eqx_ckpt chunk file, which steps share; these files are named in the message.)
    problems = [Problem(r.path, bad[r.path].message) for r in records if r.path in bad]
    if differ:
        problems.insert(0, _other_values(source, differ))
    if missing is not None:
        problems.insert(0, _unverified(records, taken, missing))
    said = _family_said(source, len(digests) == len(records), missing is not None)
    if hub:  # (the whole load compared every file with the Hub's digest, or refused it)
        checked = source.checked + said
        return Problems(problems, () if checked else (SAFETENSORS_UNCHECKED,), checked=checked)
    if source.format == "safetensors":
        return Problems(problems, () if said else (SAFETENSORS_UNCHECKED,), checked=said)
    return Problems(problems, (ORBAX_UNCHECKED,) + (() if _orbax.writes_every_chunk(loc) else (ORBAX_INCOMPLETE,)))


def _compare_digests(
    source: _source.Source, records: list[LeafRecord], tracker: Tracker
) -> tuple[dict[str, Problem], list[str]]:
    """What is wrong with each leaf whose bytes are not those its recorded
    digest says (or cannot be read), by dotted path; and apart, the leaves
    taken from a base whose bytes differ (one problem of the base, not one
    of each leaf). A leaf of a base that backs several leaves of a fine-tune
    is read and hashed once."""
    bad: dict[str, Problem] = {}
    differ: list[str] = []
    family = source.manifest.family
    references = {} if family is None else family.references
    hashed: dict[str, _digests.Digested | int] = {}  # by the base's dotted path (an int: its bad block)
    for record in records:
        taken = references.get(record.path)
        expected = source.manifest.digests[record.path]
        try:
            found = hashed.get(taken) if taken is not None else None
            if found is None:
                block = _verified.recorded_block(source.manifest, record)
                found = _verified.stored_digest(source, record, like=expected, block=block)
        except IntegrityError as e:
            if getattr(e, "block", None) is None:
                bad[record.path] = Problem(record.path, str(_damage(e, record, source.data, "read")))
            else:  # a block read through its check (`_verified.Region`)
                found = e.block  # type: ignore[attr-defined]
        except Exception as e:
            bad[record.path] = Problem(record.path, str(_damage(e, record, source.data, "read")))
        if record.path in bad or found is None:
            pass
        elif isinstance(found, int) or found.digest != expected:
            if taken is not None:  # (one problem of the base, not one of each leaf: `_other_values`)
                differ.append(record.path)
            else:
                bad[record.path] = Problem(record.path, _differs(source, record, found, taken))
        if taken is not None and found is not None:
            hashed[taken] = found
        tracker.advance(leaves=1, nbytes=record.nbytes)
    return bad, differ


def _other_values(source: _source.Source, differ: list[str]) -> Problem:
    """The one problem of a fine-tune whose base holds other bytes than its
    record's digests say for the leaves `differ`: the base's, not each leaf's."""
    assert source.base is not None  # (only leaves taken from a base are in `differ`)
    count = len(source.base.references)
    fix = (
        "It is not the base the fine-tune was made from: give that one (`base=`, `--with-base`)."
        if source.base.given
        else "It was rewritten, or another model is under its name: give the base the fine-tune was made from "
        "(`base=`, `--with-base`), or load a standalone export of it."
    )
    shown = f"given, {_base_shown(source)}," if source.base.given else _base_shown(source)
    return Problem(
        None,
        f"the base {shown} holds other values than when the fine-tune was exported: {len(differ)} of "
        f"the {count} {'leaf' if count == 1 else 'leaves'} taken from it ({shown_names(differ)}) "
        f"{'holds' if len(differ) == 1 else 'hold'} other bytes than the digests in {_published.NAME} record "
        f"({_verified.strength(source.manifest)}). {fix}",
    )


def _base_shown(source: _source.Source) -> str:
    """How `verify` names the base a fine-tune's leaves were read from: as
    given, or as pinned (an `hf://` base at its commit)."""
    family, base = source.manifest.family, source.base
    assert family is not None and base is not None
    opened = base.open
    if base.given:
        return repr(base.display if opened is None else opened.loc.display)
    return family.base.shown if family.base.revision or opened is None else repr(opened.loc.display)


def _differs(source: _source.Source, record: LeafRecord, found: _digests.Digested | int, taken: str | None) -> str:
    """What `verify` says of a leaf whose bytes are not those recorded (`found`:
    their digests, or the first block whose check failed)."""
    where = "" if taken is None else f" (read from the base's leaf `{taken}`)"
    expected = source.manifest.digests[record.path]
    if isinstance(found, int) or found.blocks:
        blocks, algorithm = source.manifest.blocks[record.path], source.manifest.block_algorithm
        assert algorithm is not None  # (a record of block digests names their hash)
        index = found if isinstance(found, int) else _digests.first_differing(found.blocks, blocks)
        return (
            f"its bytes{where} are not those its digests in {_published.NAME} record: block {index} of "
            f"{len(blocks) // _digests.SIZE} differs from its {algorithm.shown}: a changed byte"
        )
    return (
        f"its bytes{where} are not those its digest in {_published.NAME} records (xxh3-128 "
        f"{found.digest.removeprefix(_digests.XXH3)}, recorded {expected.removeprefix(_digests.XXH3)}): a changed byte"
    )


def _unverified(records: list[LeafRecord], taken: set[str], missing: CheckpointError) -> Problem:
    """The problem of a fine-tune whose base cannot be reached (found, or
    followed: `UntrustedError`): the leaves taken from it are not verified."""
    names = [r.path for r in records if r.path in taken]
    why = "is not followed" if isinstance(missing, UntrustedError) else "cannot be found"
    return Problem(
        None,
        f"the {len(names)} {'leaf' if len(names) == 1 else 'leaves'} taken from its base "
        f"({shown_names(names)}) {'was' if len(names) == 1 else 'were'} not verified, since the base {why}; the "
        f"{len(records) - len(names)} stored here were. {missing}",
    )


def _family_said(source: _source.Source, every: bool, missing: bool) -> tuple[str, ...]:
    """What `verify` says it checked of a published folder by its digests
    (`missing`: of a fine-tune whose base cannot be found, its own leaves)."""
    if not every:
        return ()
    strength = _verified.strength(source.manifest)
    if missing:
        return (f"every leaf stored here, against the digests {_published.NAME} records of it ({strength})",)
    said = [f"every leaf's bytes, against the digests {_published.NAME} records of it ({strength})"]
    family = source.manifest.family
    if family is not None and source.base is not None:
        count = len(family.references)
        leaves = f"{count} {'leaf' if count == 1 else 'leaves'}"
        if source.base.given:
            said.append(
                f"the {leaves} taken from its base, read from the base given, {_base_shown(source)}, against "
                f"the digests {_published.NAME} records of them (a base given is held to them; the base its record "
                f"pins, {family.base.shown}, was not read)"
            )
        else:
            said.append(
                f"its base {_base_shown(source)} is there, at the version pinned (by "
                f"{'its commit' if family.base.revision else 'the sha256 of its record'}), and the {leaves} taken "
                f"from it are read from it"
            )
    return tuple(said)
