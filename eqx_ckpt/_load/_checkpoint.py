"""`Checkpoint(path)`: look inside a checkpoint without reading its arrays."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any, cast

import equinox as eqx
import numpy as np
from jaxtyping import PyTree

from .._base import _gc, _keypath, _state
from .._base._errors import CheckpointError, CheckpointKeyError, CheckpointTypeError, check_flag
from .._base._progress import Progress
from .._ondisk import _iterators, _trust
from .._ondisk._format import SCALAR_TYPES, LeafRecord
from .._ondisk._iterators import IteratorRecord
from .._ondisk._manifest import loads_file
from .._ondisk._trust import Trust
from .._sources import _opening
from .._store import _chunk_files
from . import _deserialise, _lazy, _rebuild
from ._lazy import LazyArray
from ._load_plan import LoadOptions

# The checkpoints whose load without `trust` was warned about in this process (`_say_trust`).
_TRUST_SAID: _state.Table[str, None] = _state.table("checkpoint.trust_said", 1024, "clear")


class Checkpoint(Mapping[str, Any]):
    """A committed checkpoint, opened without reading any array.

    A read-only mapping from dotted key to [`eqx_ckpt.LazyArray`][], or, for a
    scalar leaf, its value (read when looked up). Keys are sorted segment by
    segment, numbers by value (`layers.2` before `layers.10`, `k2` before
    `k10`). `print(ckpt)` shows the saved tree, as `eqx-ckpt ls` does
    (summarised in 60 lines for large ones: see `listing`). An iterator's
    saved state (a data pipeline's position) is not a key:
    [`eqx_ckpt.Checkpoint.iterator_states`][] reads it.

    **Arguments:**

    - `path`: the checkpoint directory or kvstore URL; or a `.safetensors`
        file, a Hugging Face directory of safetensors shards, or an orbax
        PyTree checkpoint (see [docs/interop.md](../interop.md)); or a Hub
        repository, `hf://owner/name` (see [docs/sharing.md](../sharing.md)).
    - `token`: a Hugging Face Hub token, for an `hf://` path of a private or
        gated repository; `None` takes `HF_TOKEN` or the one `hf auth login` saved.
    - `base`: for a fine-tune stored against a base, where to read its base
        from instead of where its record says (any path this class opens).
        Its leaves are checked against the digests the fine-tune records.
        Needed where the recorded base is not followed on its own: anything
        but an `hf://` base or a folder beside the fine-tune (see
        [docs/sharing.md](../sharing.md#model-families)).

    **Attributes:**

    - `total_bytes`, `created`, `library_version`, `format_version`, `format`,
        `metadata` (a safetensors file's `__metadata__`), `metrics` (what
        its save committed with it: a manager's metrics, a merge's options).
    - `compression`, `stored_bytes`: how its chunks are compressed, and the
        bytes they take on a local disk (see their docstrings).

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_ckpt

        eqx_ckpt.tree_serialise_leaves("ckpt", {"model": {"w": jnp.ones((2, 3))}, "step": 7})
        ckpt = eqx_ckpt.Checkpoint("ckpt")
        print(list(ckpt))                 # ['model.w', 'step']
        print(ckpt["model.w"].shape)      # (2, 3)
        print(ckpt["step"])               # 7
        ```
    """

    # Opening makes a few objects a leaf (records, sort keys), as a load does.
    @_gc.gc_paused()
    def __init__(self, path: Any, *, token: str | None = None, base: Any = None):
        self._source = _opening.open_source(path, LoadOptions(token=token, base=base), whole=False)
        self._token = token
        self._given_base = base
        self._loc = self._source.loc
        self._manifest = self._source.manifest
        self._records = dict(sorted(self._manifest.by_path().items(), key=lambda item: _keypath.sort_key(item[0])))
        # Iterator leaves (`_iterators`): not keys of the mapping, which are array leaves.
        iterators = sorted(self._manifest.iterators, key=lambda record: _keypath.sort_key(record.path))
        self._iterators = {record.path: record for record in iterators}
        # A fine-tune's base is opened to describe it; one that cannot be reached is said (`base_missing`).
        self._base_missing = None if self._source.base is None else self._source.base.missing()

    @property
    def path(self) -> str:
        return self._loc.display

    @property
    def revision(self) -> str | None:
        """The commit a Hugging Face Hub repository (`hf://owner/name@branch`) was
        opened at, resolved once: every file is read at it. `None` otherwise."""
        return self._source.revision

    @property
    def base(self) -> str | None:
        """For a fine-tune stored as what changed (`export_safetensors(...,
        base=)`), the base its other leaves are read from, as pinned: an
        `hf://owner/name@<commit>`, or a path. `None` otherwise."""
        family, lazy = self._manifest.family, self._source.base
        if family is None or lazy is None:
            return None
        base = lazy.open
        if base is None:  # (a base that cannot be found)
            return lazy.display
        return family.base.shown if family.base.revision and base.revision == family.base.revision else base.loc.display

    @property
    def base_missing(self) -> str | None:
        """For a fine-tune whose base cannot be reached, why (in one sentence);
        else `None`. The base cannot be found, or its record names it where a
        load does not follow on its own (an absolute path, a URL: nothing
        there is opened). Its own leaves still load (`prefix`, `where`), and
        `ls`, `info` and `verify` describe it. A load of a leaf taken from the
        base raises [`eqx_ckpt.CheckpointNotFoundError`][] (saying how to load
        it without the base) or [`eqx_ckpt.UntrustedError`][] (saying to give
        the base, `base=`)."""
        base = self._source.base
        return None if self._base_missing is None or base is None else base.reason(self._base_missing)

    def from_base(self) -> dict[str, str]:
        """For a fine-tune, each leaf read from its base (by dotted path), with
        the base's leaf holding its bytes; `{}` for every other source."""
        family = self._manifest.family
        references = {} if family is None else family.references
        return dict(sorted(references.items(), key=lambda item: _keypath.sort_key(item[0])))

    @property
    def total_bytes(self) -> int:
        return self._manifest.total_bytes

    @property
    def compression(self) -> str | None:
        """How its chunks are compressed (`compression=` of the save, such as
        `"blosc-lz4"`), or `None` for none."""
        names = {p.compression for p in self._manifest.packs} | {r.compression for r in self._manifest.leaves}
        return ", ".join(sorted(names - {""})) or None

    @property
    def stored_bytes(self) -> int | None:
        """The bytes its arrays' chunk files take (compressed, where they are),
        on a local disk; `None` elsewhere, where storage does not list sizes."""
        return _chunk_files.stored_bytes(self._source.data, self._manifest) if self.format == "eqx_ckpt" else None

    @property
    def created(self) -> str:
        return self._manifest.created

    @property
    def library_version(self) -> str:
        return self._manifest.library_version

    @property
    def layout(self) -> str:
        """`"directories"` (one folder per leaf) or `"ocdbt"` (one key-value store)."""
        return self._manifest.layout

    @property
    def format(self) -> str:
        """`"eqx_ckpt"`, or the format of another source: `"safetensors"`, `"orbax"`."""
        return self._source.format

    @property
    def format_version(self) -> int:
        return self._manifest.format_version

    @property
    def info(self) -> dict[str, Any]:
        """The `info` of a folder `export_safetensors` wrote (a description,
        hyperparameters, metrics...). Empty for other checkpoints."""
        return copy.deepcopy(self._manifest.info)

    @property
    def metrics(self) -> dict[str, Any]:
        """The numbers and strings its save committed with it: a manager's
        step's `metrics`, or how [`eqx_ckpt.merge`][] made it (`merge_method`,
        `merge_inputs`...). Empty for other checkpoints."""
        return dict(self._manifest.metrics)

    @property
    def metadata(self) -> dict[str, str]:
        """The strings a safetensors file keeps in its header's `__metadata__`
        (`{"format": "pt"}`); for a Hugging Face directory those of its shards
        (a key whose value differs between shards as `file:key`). Else empty."""
        return dict(self._manifest.metadata)

    def record(self, key: str) -> LeafRecord:
        """The manifest record of one leaf (shape, dtype, stored dtype, chunks...)."""
        try:
            return self._records[key]
        except KeyError:
            raise CheckpointKeyError(self._missing(key), path=self.path) from None

    def _missing(self, key: Any) -> str:
        inside = [path for path in self._iterators if isinstance(key, str) and key and _keypath.is_within(path, key)]
        if inside and (key in self._iterators or not any(_keypath.is_within(p, key) for p in self._records)):
            return self._iterator_key(key, inside)
        if not isinstance(key, str):
            return (
                f"{key!r} is not a leaf of checkpoint {self.path!r}: leaves are named by their dotted "
                f"paths, strings such as {next(iter(self._records), 'model.weight')!r}. "
                f"`Checkpoint(path).keys()` lists them all."
            )
        close = [k for k in self._records if k.startswith(key.split(".")[0])][:5]
        hint = f" Keys starting alike: {close}." if close else ""
        return f"{key!r} is not a leaf of checkpoint {self.path!r}.{hint} `Checkpoint(path).keys()` lists them all."

    def _iterator_key(self, key: str, inside: list[str]) -> str:
        """That `key` names an iterator's state, or a sub-tree holding only
        iterators (`inside`), and how to read them."""
        if key in self._iterators:
            return (
                f"{key!r} is the saved state of an iterator in checkpoint {self.path!r}, not an array leaf. "
                f"`Checkpoint(path).iterator_states()[{key!r}]` reads it; a load puts it back into the iterator "
                f"at that path of `like`."
            )
        shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more" if len(inside) > 3 else "")
        return (
            f"{key!r} holds no array leaf of checkpoint {self.path!r}, only the saved states of iterators "
            f"({shown}). `Checkpoint(path).iterator_states()` reads them; a load puts them back into the "
            f"iterators at those paths of `like`."
        )

    def iterator_states(self) -> dict[str, list[Any]]:
        """The saved state of each iterator of the tree (a leaf with
        `get_state()` and `set_state(state)`, such as a Grain iterator), by
        dotted path, sorted; `{}` where there is none. Each is a list of its
        states by JAX process index, as `get_state()` gave them: a JSON value,
        or bytes. Each state is checked (its size, kind and digest) as a load
        checks it before `set_state` sees it.

        The mapping's keys are the array leaves only: a load puts these states
        back into the iterators of `like` (see [docs/manager.md](../manager.md#resuming-the-data)).

        **Raises:**

        [`eqx_ckpt.IntegrityError`][] naming the leaf if a state is damaged.

        !!! example

            ```python
            import grain, jax.numpy as jnp
            import eqx_ckpt

            data = iter(grain.MapDataset.range(10).batch(2))
            next(data)
            eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(2), "data": data})
            print(eqx_ckpt.Checkpoint("ckpt").iterator_states())  # {'data': [{'next_index': 1}]}
            ```
        """
        return {
            path: [_iterators.check_state(s, path, checkpoint=self.path, loads=loads_file) for s in record.states]
            for path, record in self._iterators.items()
        }

    def __getitem__(self, key: str) -> Any:
        lazy = LazyArray(self._source, self.record(key))
        if self._records[key].type in SCALAR_TYPES:
            value = lazy[()]
            return value.item() if self._records[key].type != "numpy_scalar" else value[()]
        return lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __repr__(self) -> str:
        count = len(self._iterators)
        iterators = f", {count} iterator{'' if count == 1 else 's'}" if count else ""
        return f"Checkpoint({self.path!r}, {len(self)} leaves{iterators}, {self.total_bytes} bytes)"

    def __str__(self) -> str:
        metadata = f"metadata: {self._manifest.metadata}\n" if self._manifest.metadata else ""
        return f"Checkpoint {self.path!r}:\n{metadata}" + self.listing(max_rows=_MAX_ROWS)

    def listing(self, *, depth: int | None = None, max_rows: int | None = None, values: bool = False) -> str:
        """The saved tree, one key per line, indented, with `dtype[shape]` and size,
        then the totals (what `eqx-ckpt ls` prints). An iterator's line says
        the kind of its state (`json` or `bytes`), how many processes saved
        one, and the size of the largest: `iterator (json, 1 process)  16 B`
        (`iterator_states` reads them).

        **Arguments:**

        - `depth`: show only this many levels; a sub-tree below them is one line,
            with its number of leaves and bytes.
        - `max_rows`: show at most this many lines of the tree. Sub-trees open
            breadth first, each whose entries still fit; then one too large
            shows its first 5 entries and how many more it has; any other is
            one line, with its number of leaves and bytes
            (`print(Checkpoint(path))` shows at most 60 lines).
        - `values`: also print the value of every leaf of at most
            `SMALL_VALUES` (16) elements (what `eqx-ckpt ls --values` prints).

        **Returns:**

        The listing, as a string.

        !!! example

            ```python
            import jax.numpy as jnp
            import eqx_ckpt

            eqx_ckpt.tree_serialise_leaves("ckpt", {"model": {"w": jnp.ones((2, 3))}, "step": 7})
            print(eqx_ckpt.Checkpoint("ckpt").listing())
            ```
        """
        values = check_flag("values", values, "whether to print small leaves' values")
        for name, count in (("depth", depth), ("max_rows", max_rows)):
            if count is not None and (type(count) is not int or count < 0):
                raise CheckpointTypeError(f"`{name}` must be an int of at least 0 or None, not {count!r}.")
        family = self._manifest.family
        root = _Folder.of(self._entries(), () if family is None else family.references)
        shown = _shown(root, max_rows=max_rows, depth=depth)
        rows = self._rows(root, shown, values=values) if shown else []
        # A sub-tree's "... and N more" row (one column) sets no column's width.
        width = max((len(r[0]) for r in rows if len(r) > 1), default=0)
        kind = max((len(r[1]) for r in rows if len(r) > 1), default=0)
        lines = [
            f"{r[0]:<{width}}  {r[1]:<{kind}}  {r[2]:>10}{''.join(r[3:])}".rstrip() if len(r) > 1 else r[0]
            for r in rows
        ]
        # A leaf's row (an iterator's too) has a value.
        unlisted = len(self._records) + len(self._iterators) - sum(1 for row in rows if len(row) == 4)
        if max_rows is not None and unlisted:
            lines.append(f"... {unlisted} leaves not listed one by one (`Checkpoint(path).listing()` lists them all)")
        lines.append(f"{len(self)} leaves, {human(self.total_bytes)}{self._stored()}{self._iterated()}")
        taken = self.from_base()
        if taken:
            nbytes = sum(self._records[path].nbytes for path in taken)
            lines[-1] += (
                f"; {len(taken)} of them ({human(nbytes)}, marked `base`) read from the base {self.base}, "
                f"{len(self) - len(taken)} stored here"
            )
            if self.base_missing is not None:
                here = len(self) - len(taken)
                lines.append(
                    f"The base cannot be reached: {self.base_missing} Only the {here} "
                    f"{'leaf stored here loads' if here == 1 else 'leaves stored here load'} without it."
                )
        return "\n".join(lines)

    def _entries(self) -> Mapping[str, LeafRecord | IteratorRecord]:
        """The array leaves and the iterators, in key order."""
        if not self._iterators:
            return self._records
        both: dict[str, LeafRecord | IteratorRecord] = {**self._records, **self._iterators}
        return dict(sorted(both.items(), key=lambda item: _keypath.sort_key(item[0])))

    def _iterated(self) -> str:
        """The totals line's count of iterators, and the bytes of their largest states, if any."""
        count = len(self._iterators)
        if not count:
            return ""
        nbytes = sum(record.nbytes for record in self._iterators.values())
        return f"; {count} iterator{'' if count == 1 else 's'}, {human(nbytes)} of state"

    def _stored(self) -> str:
        """The totals line's note on compression, if any."""
        if self.compression is None:
            return ""
        stored = self.stored_bytes
        return f", stored compressed ({self.compression})" + (f" in {human(stored)}" if stored is not None else "")

    def _rows(self, folder: _Folder, shown: dict[int, int], *, values: bool, level: int = 0) -> list[tuple[str, ...]]:
        """The rows of `folder`'s first `shown` entries: a leaf, a shown sub-tree
        with its rows below it, or a sub-tree's number of leaves and bytes."""
        rows: list[tuple[str, ...]] = []
        indent, count = "  " * level, shown[id(folder)]
        for (name, _), entry in itertools.islice(folder.entries.items(), count):
            if isinstance(entry, _Folder) and id(entry) in shown:
                rows.append((f"{indent}{name}/", "", ""))
                rows += self._rows(entry, shown, values=values, level=level + 1)
            elif isinstance(entry, _Folder):
                rows.append((f"{indent}{name}/", entry.holds(), human(entry.nbytes)))
            elif entry in self._iterators:
                iterator = self._iterators[entry]
                rows.append((indent + name, _iterators.describe(iterator), human(iterator.nbytes), ""))
            else:
                record = self._records[entry]
                taken = self._manifest.family is not None and entry in self._manifest.family.references
                small = values and math.prod(record.shape) <= SMALL_VALUES
                small = small and not (taken and self._base_missing is not None)  # (its value is in the base)
                value = f"  = {_one_line(self[entry])}" if small else ""
                if taken:
                    value = "  base" + value
                rows.append((indent + name, describe(record), human(record.nbytes), value))
        if count < len(folder.entries):
            rows.append((f"{indent}... and {len(folder.entries) - count} more",))
        return rows

    @_gc.gc_paused()  # a record makes many small objects, as a load does
    def skeleton(self, prefix: str | None = None, *, trust: Iterable[Any] = (), check_init: bool = False) -> PyTree:
        """The saved tree (or its sub-tree at dotted `prefix`) rebuilt from its
        structure record with its own classes, holding no data: a `like` for
        every load ([`eqx_ckpt.tree_deserialise_leaves`][] with `where`,
        `prefix`, `lazy`, `cast`, shardings...), made without the model's code.

        Its leaves:

        - Stored JAX arrays and PRNG key arrays are `jax.ShapeDtypeStruct`s.
        - A stored NumPy array is a zero-strided read-only array of its shape
            and dtype: no memory, and a load gives NumPy back.
        - A stored scalar is a zero of its type (`0`, `0.0`, `np.float32(0)`).

        Every other leaf and static field (strings, numbers, tuples, dtypes,
        enums, functions such as `jax.nn.gelu`) is as it was saved.

        Objects are built as `jax.tree_util.tree_unflatten` builds an Equinox
        module: `object.__new__`, then the recorded fields set one by one, so
        no `__init__`, `__post_init__` or `__check_init__` runs
        (`check_init=True` runs the last). A class that is not trusted is
        never looked up, let alone imported: see [docs/structure.md](../structure.md).

        **Arguments:**

        - `prefix`: a dotted path of the saved tree (`"model"`); `None`: all of it.
        - `trust`: the classes, functions and modules the tree may use beyond
            the default set (Equinox's `nn` layers and `State`, `jax.nn` and the
            elementwise `jax.numpy` functions). A module trusts every class and
            function defined in it and its submodules (`trust=[optax]`).
        - `check_init`: run each rebuilt Equinox module's `__check_init__`.

        **Raises:**

        - [`eqx_ckpt.UntrustedError`][] naming every class and function that
            is not trusted, where they are used and the `trust=[...]` to pass.
        - `CheckpointTypeError` if a class's fields changed since the save.
        - `CheckpointValueError` for a part that could not be recorded (a
            lambda, a closure) or a checkpoint that records no structure
            (written before format 5, or by another library).

        !!! example

            ```python
            import equinox as eqx, jax
            import eqx_ckpt

            model = eqx.nn.MLP(2, 2, 8, 2, activation=jax.nn.gelu, key=jax.random.key(0))
            eqx_ckpt.tree_serialise_leaves("ckpt", {"model": model, "step": 3})
            like = eqx_ckpt.Checkpoint("ckpt").skeleton("model")
            print(like.layers[0].weight)          # ShapeDtypeStruct(shape=(8, 2), dtype=float32)
            print(like.activation is jax.nn.gelu)  # True
            ```
        """
        return _deserialise.rebuilt(self._source, self._key(prefix, "skeleton"), Trust(trust), check_init=check_init)

    @_gc.gc_paused()
    def types(self, prefix: str | None = None, *, trust: Iterable[Any] | None = None) -> dict[str, list[str]]:
        """The classes, functions and enums a load without `like` of the tree
        (or its sub-tree at `prefix`) builds, as `module:qualname`, each with
        the dotted paths that use it, sorted. Nothing is imported or built.

        With `trust` (as [`eqx_ckpt.Checkpoint.skeleton`][] takes it; `[]` for
        the default set alone), only those it does not trust: what is left to
        pass. `eqx-ckpt ls --types PATH` prints both.

        !!! example

            ```python
            import equinox as eqx, jax
            import eqx_ckpt

            eqx_ckpt.tree_serialise_leaves("ckpt", eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0)))
            print(list(eqx_ckpt.Checkpoint("ckpt").types()))  # ['equinox.nn._linear:Linear', ...]
            print(eqx_ckpt.Checkpoint("ckpt").types(trust=[]))  # {}: all trusted by default
            ```
        """
        prefix = self._key(prefix, "types")
        node = _rebuild.subtree(self._manifest, prefix, self.path)
        names = _rebuild.names(node, prefix, self.path)
        checker = Trust(trust) if trust is not None else None
        return {
            name: sorted(paths, key=_keypath.sort_key)
            for name, paths in sorted(names.items())
            if checker is None or checker.resolve(name) is None
        }

    def unrecordable(self, prefix: str | None = None) -> dict[str, str]:
        """The parts of the tree (or of its sub-tree at `prefix`) that its save
        could not record as data (a lambda, a closure, an arbitrary object),
        by dotted path (`""`: the whole tree), each with what it was, sorted.
        A load without `like` cannot rebuild them (a `CheckpointValueError`):
        load with `like`, or a sub-tree without them (`prefix=`).
        `eqx-ckpt ls --types PATH` lists them.

        !!! example

            ```python
            import jax.numpy as jnp
            import eqx_ckpt

            eqx_ckpt.tree_serialise_leaves("ckpt", {"w": jnp.ones(2), "act": lambda x: x})
            print(eqx_ckpt.Checkpoint("ckpt").unrecordable())   # {'act': 'a lambda ...'}
            ```
        """
        prefix = self._key(prefix, "unrecordable")
        node = _rebuild.subtree(self._manifest, prefix, self.path)
        found = _rebuild.unrecordable(node, prefix, self.path)
        return {path: found[path] for path in sorted(found, key=_keypath.sort_key)}

    def _key(self, key: Any, method: str) -> str:
        if key is not None and not isinstance(key, str):
            raise CheckpointTypeError(
                f"`Checkpoint.{method}`'s `prefix` must be a dotted path such as 'model.encoder' (or `None` for "
                f"everything), not {type(key).__name__}. To load into a skeleton such as `like`, use "
                f"`eqx_ckpt.tree_deserialise_leaves(path, like)`.",
                path=self.path,
            )
        return key or ""

    @_gc.gc_paused()
    def load(
        self,
        prefix: str | None = None,
        *,
        lazy: bool = False,
        progress: Progress = None,
        trust: Iterable[Any] | None = None,
        check_init: bool = False,
        key: str | None = None,
    ) -> Any:
        """Load the checkpoint, or the sub-tree at dotted `prefix`, without a skeleton.

        With `trust` (a list, empty for the default set only), the saved tree
        is rebuilt with its own classes ([`eqx_ckpt.Checkpoint.skeleton`][],
        whose `trust` and `check_init` these are) and loaded into, through the
        same reader as [`eqx_ckpt.tree_deserialise_leaves`][].

        Without `trust`, the tree is rebuilt from the key paths in the manifest:

        - Dict keys and attribute names become nested dicts.
        - Sequence indices become lists. An index that holds no saved leaf,
            such as an activation function between layers, is `None`.
        - A safetensors file's names do not say what is a list. There, children
            named `0`, `1`, ... without gaps become a list.

        Arrays saved from JAX come back as JAX arrays on the default device.
        But when any of them is 64-bit and JAX's x64 mode is off, all come back
        as NumPy arrays, which keep every value. NumPy arrays come back as NumPy
        arrays, scalars as their values.

        **Arguments:**

        - `prefix`: a dotted path (`"model.encoder"`, or one leaf's path); `None` loads
            everything. (Called `key` before format 5; `key=` still works, with a
            `DeprecationWarning`.)
        - `lazy`: return [`eqx_ckpt.LazyArray`][]s that read when asked (scalars
            still come back as values); [`eqx_ckpt.materialise`][] reads them.
        - `progress`: as for [`eqx_ckpt.tree_deserialise_leaves`][].
        - `trust`, `check_init`: rebuild the saved classes, as
            [`eqx_ckpt.Checkpoint.skeleton`][] does (see above).

        **Returns:**

        Nested dicts and lists of arrays and scalars (or the leaf itself when `prefix`
        names one); with `trust`, the saved tree with its own classes.

        **Raises:**

        [`eqx_ckpt.CheckpointKeyError`][] if no leaf lies at or below `prefix`.

        !!! example

            ```python
            import equinox as eqx, jax
            import eqx_ckpt

            model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
            eqx_ckpt.tree_serialise_leaves("ckpt", {"model": model, "step": 3})
            state = eqx_ckpt.Checkpoint("ckpt").load()
            print(state["step"], state["model"]["layers"][0]["weight"].shape)  # 3 (8, 2)
            ```
        """
        if key is not None:
            warnings.warn(
                "`Checkpoint.load`'s `key` is now called `prefix`: pass `prefix=` (or the dotted path first).",
                DeprecationWarning,
                stacklevel=2,
            )
            prefix = key if prefix is None else prefix
        key = self._key(prefix, "load")
        lazy = check_flag("lazy", lazy, "whether to return `LazyArray`s that read when asked")
        if not key and not lazy:
            self._download()
        if trust is not None:
            like = self.skeleton(key, trust=trust, check_init=check_init)
            options = LoadOptions(prefix=key, lazy=lazy, progress=progress)
            return _deserialise.load(self._source, like, None, _deserialise.default_deserialise_filter_spec, options)
        records = [r for path, r in self._records.items() if _keypath.is_within(path, key)]
        if key and not records:
            raise CheckpointKeyError(self._missing(key), path=self.path)
        self._say_trust(key)
        return _lazy.nested(self._source, records, key, lazy=lazy, progress=progress, numbered=self._numbered)

    def _say_trust(self, prefix: str) -> None:
        """Warn, once per model, that a load without `trust` of a published model
        whose record names classes returns nested dicts, and which `trust`
        rebuilds it. (An eqx_ckpt checkpoint's nested dicts are documented.)"""
        published = self._source.format == "safetensors" and self._manifest.layout == "published"
        if not published or self.path in _TRUST_SAID or self._manifest.structure is None:
            return
        try:
            classes = [n for n in self.types(prefix or None) if not n.startswith("builtins:")]
            untrusted = list(self.types(prefix or None, trust=[]))
        except CheckpointError:  # a record that cannot be rebuilt: `unrecordable` says why
            return
        if not classes:
            return
        _TRUST_SAID.put(self.path, None)
        shown = ", ".join(f"`{_trust.python_name(n)}`" for n in classes[:3]) + (" ..." if len(classes) > 3 else "")
        trusted = ", ".join(_trust.python_name(n) for n in untrusted)
        warnings.warn(
            f"{self.path!r}: `load()` without `trust` returns nested dicts and lists of arrays, though the tree "
            f"records its classes and functions ({shown}). To get the tree back as it was saved, pass "
            f"`.load(trust=[{trusted}])`" + ("" if untrusted else " (the default trust covers them)") + ".",
            UserWarning,
            stacklevel=4,  # (past `load` and its `gc_paused` wrapper)
        )

    def _download(self) -> None:
        """Before a load of all of a Hub repository opened by byte ranges, fetch
        its files into the Hub's cache (at the same commit) and read them there."""
        pinned = self._source.pinned
        if pinned is not None and self._source.loc.local is None:
            options = LoadOptions(token=self._token, base=self._given_base)
            self._source = _opening.open_source(self._source.loc, options, whole=True, pinned=pinned)

    @property
    def _numbered(self) -> bool:
        """Whether numbered children are lists though the key paths do not say
        so, as safetensors names never do outside the published layout."""
        return self._source.format == "safetensors" and self._manifest.layout != "published"

    def tree(self) -> Any:
        """The saved tree as nested dicts of dotted segments (and lists, where
        `load()` gives lists: sequence indices, and numbered names `0`, `1`...
        of a safetensors file), with a `"dtype[shape]"` description at each
        leaf (never reads arrays)."""
        _lazy.refuse_leaves_with_children(list(self._records), self.path)
        records = list(self._records.values())
        if len(records) == 1 and records[0].path == "":
            return {"": describe(records[0])}
        return _lazy.structure(records, "", describe, numbered=self._numbered, names=True)


# The lines `print(Checkpoint(path))` shows at most.
_MAX_ROWS = 60
# The first entries a listing shows of a sub-tree too large to show whole.
_SAMPLE = 5


class _Folder:
    """A sub-tree of a listing: its entries in key order (a sub-tree or a leaf's
    dotted key; in a foreign format a name may be both), its array leaves,
    iterators and bytes (an iterator's: its largest state)."""

    __slots__ = ("based", "entries", "iterators", "leaves", "level", "nbytes")

    def __init__(self, level: int):
        self.entries: dict[tuple[str, bool], _Folder | str] = {}
        self.level, self.leaves, self.iterators, self.nbytes, self.based = level, 0, 0, 0, 0

    @staticmethod
    def of(records: Mapping[str, LeafRecord | IteratorRecord], taken: Container[str] = ()) -> _Folder:
        """The sub-trees of `records`, counting in each its leaves that are `taken` from a base (`based`)."""
        root = _Folder(0)
        for key, record in records.items():
            parts = _keypath.split_dotted(key) or ("<root>",)
            folder = root
            for part in parts[:-1]:
                folder.count(record, based=key in taken)
                # Keyed `(part, True)`: always a sub-tree.
                folder = cast(_Folder, folder.entries.setdefault((part, True), _Folder(folder.level + 1)))
            folder.count(record, based=key in taken)
            folder.entries[(parts[-1], False)] = key
        return root

    def count(self, record: LeafRecord | IteratorRecord, *, based: bool) -> None:
        iterator = isinstance(record, IteratorRecord)
        self.leaves, self.iterators = self.leaves + (not iterator), self.iterators + iterator
        self.nbytes, self.based = self.nbytes + record.nbytes, self.based + based

    def holds(self) -> str:
        """Its leaves and iterators, as a listing's line of a sub-tree says them."""
        leaves = "1 leaf" if self.leaves == 1 else f"{self.leaves} leaves"
        said = [] if self.leaves == 0 and self.iterators else [leaves]
        if self.based:
            said[-1] += f" ({self.based} from the base)"
        if self.iterators:
            said.append("1 iterator" if self.iterators == 1 else f"{self.iterators} iterators")
        return ", ".join(said)


def _shown(root: _Folder, *, max_rows: int | None, depth: int | None) -> dict[int, int]:
    """How many entries of each sub-tree (by `id`) a listing shows (see
    `listing`); a sub-tree not here is one line. The smaller open first within
    a level, so a small model beside a large sibling shows its layers."""
    if depth == 0:
        return {}
    budget = math.inf if max_rows is None else max_rows
    shown = {id(root): len(root.entries) if len(root.entries) <= budget else max(int(budget) - 1, 0)}
    lines, level, too_large = min(len(root.entries), budget), _folders_in(root, shown), []
    while level:
        below = []
        for folder in sorted(level, key=lambda folder: len(folder.entries)):
            if depth is not None and folder.level >= depth:
                continue
            if lines + len(folder.entries) > budget:
                too_large.append(folder)
                continue
            shown[id(folder)] = len(folder.entries)
            lines += len(folder.entries)
            below += _folders_in(folder, shown)
        level = below
    for folder in too_large:
        sample = min(_SAMPLE, int(budget - lines) - 1)
        if sample < 1:
            break
        shown[id(folder)] = sample
        lines += sample + 1
    return shown


def _folders_in(folder: _Folder, shown: dict[int, int]) -> list[_Folder]:
    """The sub-trees among `folder`'s shown entries."""
    entries = itertools.islice(folder.entries.values(), shown[id(folder)])
    return [entry for entry in entries if isinstance(entry, _Folder)]


def human(n: float) -> str:
    """A byte count for people: `1.5 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(record: LeafRecord) -> str:
    shape = ",".join(str(n) for n in record.shape)
    stored = (
        "" if record.stored_dtype == record.dtype or record.type == "prng_key" else f" (stored {record.stored_dtype})"
    )
    return f"{record.dtype}[{shape}]{stored}"


def skeleton(fn: Callable[..., PyTree], *args: Any, **kwargs: Any) -> PyTree:
    """The abstract tree `fn(*args, **kwargs)` would return, allocating nothing:
    `eqx.filter_eval_shape`. Array leaves are `jax.ShapeDtypeStruct`s.

    !!! example

        ```python
        import equinox as eqx, jax
        import eqx_ckpt

        like = eqx_ckpt.skeleton(eqx.nn.Linear, 1024, 1024, key=jax.random.key(0))
        ```
    """
    return eqx.filter_eval_shape(fn, *args, **kwargs)


# `listing(values=True)` (and `eqx-ckpt ls --values`) prints leaves of at most this many elements.
SMALL_VALUES = 16


def _one_line(leaf: Any) -> str:
    """A small leaf's value on one line (a scalar leaf is its value already)."""
    if isinstance(leaf, (bool, int, float, complex)):
        # A NumPy scalar (`np.float64` is a `float`) as its plain value, not `np.float64(0.1)`.
        return repr(leaf.item() if isinstance(leaf, np.generic) else leaf)
    return np.array2string(np.asarray(leaf), separator=", ", max_line_width=2**31).replace("\n", "")


def need(tree: Any, paths: Iterable[str]) -> None:
    """For a `Checkpoint` `tree`, `Source.need`; any other tree needs nothing."""
    if isinstance(tree, Checkpoint):
        tree._source.need(paths)
