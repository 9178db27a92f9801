"""Runs of a location's packs, read for one load, made by the location's
`_storage.ChunkFiles` (`pack_runs`; `_load/_pack.py` cuts the runs and
places their leaves): every run is read here and none is declined.

A run is read one of two ways, chosen from what the location's chunk files
take: by eqx_ckpt itself on a local disk (`_storage.LocalFiles.start_pack_run`,
`_local_read`: the whole chunk files holding it, each checked, then read),
else through TensorStore's array of the pack (`_storage.open_pack`), opened
once per pack for the load, which reads the run's elements. A load that
reads a few leaves at a time (`cached`: a lazy leaf) reads every run
through TensorStore, whose process-wide open of the pack keeps its decoded
chunks for the neighbours' reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base._location import Location
from .._ondisk._format import LeafRecord, PackRecord
from ._storage_errors import leaf_io_error

if TYPE_CHECKING:
    from ._storage import Mapped

Read = Callable[[], np.ndarray]


class PackRuns:
    """The runs of packs in `loc` read by one load: by `local` (eqx_ckpt's
    own read of a run, `LocalFiles.start_pack_run`) where given, else through
    the pack's array (`open_pack`, as `_storage.open_pack` takes it)."""

    def __init__(
        self, loc: Location, local: Callable[[PackRecord, int, int], Read] | None, open_pack: Callable[..., Mapped], *,
        cached: bool,
    ) -> None:  # fmt: skip
        self._loc, self._local, self._open_pack, self._cached = loc, local, open_pack, cached
        self._stores: dict[str, Mapped] = {}

    def start(self, pack: PackRecord, start: int, stop: int, leaf: LeafRecord) -> Read:
        """Start reading elements `[start, stop)` of `pack`, whose first
        member read is `leaf`; the returned function waits and returns them.
        A failure of the read is raised as storage raised it, by the returned
        function (the caller finds which leaf of the run is damaged); a
        failure to open the pack is `leaf`'s, raised here."""
        if self._local is not None and start < stop:  # (an empty run holds no chunk to read)
            return _deferred(self._local, pack, start, stop)
        if pack.name not in self._stores:
            self._stores[pack.name] = self._open_pack(self._loc, pack, cached=self._cached, leaf=leaf.path)
        try:
            store = self._stores[pack.name].result()
        except Exception as e:
            raise leaf_io_error(e, leaf, self._loc, "open") from e
        return store[start:stop].read().result


def _deferred(local: Callable[[PackRecord, int, int], Read], pack: PackRecord, start: int, stop: int) -> Any:
    """`local(pack, start, stop)`, a failure to start it raised when the run
    is finished, where the caller finds which leaf is damaged."""
    try:
        return local(pack, start, stop)
    except Exception as e:
        error = e

        def failed() -> Any:
            raise error

        return failed
