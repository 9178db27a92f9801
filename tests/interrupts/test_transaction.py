"""Fault injection into the save transaction: every I/O step of a save fails in
turn, first with an exception, then with a KeyboardInterrupt (what Ctrl-C or a
SIGTERM handler calling `sys.exit` raises in the saving thread).

For a first save, an overwrite and a manager save, the fault points of every
I/O step (`eqx_ckpt._base._faults`: storage, syncs, the chunk writes) are counted on
a clean run, in every thread the save uses; then the save is repeated with
call k failing, for every k. After each: the checkpoint loads as exactly the old
or exactly the new save, an interrupt reaches the caller as itself, the user's
files in the directory are unchanged, and the next save succeeds and leaves
nothing behind.

Every test here saves and loads in a folder in memory (`ramdisk`): the
same code, without a busy disk's fsyncs, for the hundreds of small saves each makes.
"""

import contextlib
import functools
import gc
import inspect
import linecache
import os
import pathlib
import sys
import threading
import types
import warnings

import numpy as np
import pytest
import ramdisk
from arrays import tree_equal
from disk import snapshot

import eqx_ckpt
from eqx_ckpt._base import _faults, _interrupts, _location
from eqx_ckpt._load import _pack
from eqx_ckpt._ondisk import _format
from eqx_ckpt._save import _records
from eqx_ckpt._store import _local_read, _memory, _storage

# Every fault point at which a save touches storage (see `eqx_ckpt._base._faults`).
_IO = [
    "storage.open",
    "storage.create_array",  # an array of its own, or a pack of small leaves
    "storage.transaction",
    "sync.flush",
    "storage.remove",
    "storage.remove_written",
    "storage.list",
    "storage.read_file",
    "storage.read_generation",
    "commit.manifest_write",
    "sync.directory",
    "sync.create_directory",
    "storage.delete_file",
    "local_write.chunk",  # a chunk file written by eqx_ckpt itself
    "share.link",  # a chunk file shared with the save before (incremental saves)
]

# The threads a save does its I/O in: the caller's, the helper that keeps every
# future an interrupt could lose (`_interrupts.uninterrupted`), and the chunk writers.
_SAVE_THREADS = ("eqx_ckpt-io", "eqx_ckpt-write", "eqx_ckpt-codec")


class Injected(OSError):
    pass


@contextlib.contextmanager
def inject(fail_at, error):
    """Count the fault points reached at the I/O steps; call number `fail_at`
    raises `error`. Only the save's own threads count: another test's
    object-store lease, still held by a manager in this process, renews itself
    from its own thread."""
    calls = []
    me = threading.get_ident()
    lock = threading.Lock()

    def reached(name, *args):
        thread = threading.current_thread()
        if thread.ident != me and not thread.name.startswith(_SAVE_THREADS):
            return
        with lock:
            calls.append(name)
            failing = len(calls) - 1 == fail_at
        if failing:
            raise error(f"injected at call {fail_at} ({name})")

    with _faults.armed({name: functools.partial(reached, name) for name in _IO}):
        yield calls


def _tree(generation):
    # `frozen` never changes: an overwrite or a manager's next step shares its
    # chunk file with the save before (`share.link`), as incremental saves do.
    return {
        "a": np.full(3, generation, np.float32),
        "b": {"c": np.arange(2) + generation},
        "frozen": np.arange(4, dtype=np.float32),
        "step": generation,
    }


@pytest.fixture
def tmp_path(tmp_path):
    """The test's folder, in memory (see the module docstring)."""
    with ramdisk.folder(tmp_path) as folder:
        yield folder


@pytest.fixture(autouse=True)
def mixed(monkeypatch):
    """Leaves of at most 8 bytes packed: every save writes both kinds of array, a
    pack (`step`) and arrays of their own (`a`, `b.c`), as a model's few large
    weights and many small leaves would."""
    monkeypatch.setattr(_records, "PACK_BYTES", 8)


def _holds(path, generation):
    loaded = eqx_ckpt.tree_deserialise_leaves(path, _tree(0))
    return tree_equal(loaded, _tree(generation), typematch=True) and eqx_ckpt.verify(path) == []


# The user's files: beside the checkpoint, and (for an overwrite) inside the
# folders of the checkpoint it replaces: a leaf's (`a`) and a group's (`b`).
_USERS = ("logs", "notes", "a/notes", "b/notes")


def _user_files(directory: pathlib.Path, inside=()):
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    (directory / "logs" / "run1.txt").write_text("user log")
    (directory / "notes.txt").write_text("user notes")
    for folder in inside:
        (directory / folder / "notes.txt").write_text(f"user notes in {folder}")
    return _users(directory)


def _users(directory):
    return {k: v for k, v in snapshot(directory).items() if k.startswith(_USERS)}


def _unchanged(directory, files):
    return _users(directory) == files


class _Scenario:
    """One kind of save: `prepare` makes the state before, `save` runs the save
    under test, `which` says which generation is visible."""

    def __init__(self, kind, directory):
        self.kind, self.directory = kind, directory
        self.manager = None

    def prepare(self):
        if self.kind == "overwrite":
            eqx_ckpt.tree_serialise_leaves(self.directory, _tree(1))
            return _user_files(self.directory, inside=("a", "b"))
        elif self.kind == "manager":
            self.manager = eqx_ckpt.CheckpointManager(self.directory, max_to_keep=1)
            self.manager.save(1, _tree(1), metrics={"loss": 1.0})
        else:
            # A first save is only made into an empty directory: no user files.
            self.directory.mkdir()
            return {}
        return _user_files(self.directory)

    def save(self, generation):
        if self.kind == "manager":
            self.manager.save(generation, _tree(generation), metrics={"loss": float(generation)})
        else:
            eqx_ckpt.tree_serialise_leaves(self.directory, _tree(generation))

    def which(self, generations):
        if self.kind == "manager":
            fresh = eqx_ckpt.CheckpointManager(self.directory)
            steps = fresh.all_steps()
            assert len(steps) >= 1 and set(steps) <= set(generations), steps
            for step in steps:
                assert _holds(fresh.step_path(step), step)
                assert fresh.metrics(step) == {"loss": float(step)}
            return max(steps)
        if not (self.directory / "manifest.json").exists():
            return None
        [found] = [g for g in generations if _holds(self.directory, g)]
        return found

    def close(self):
        if self.manager is not None:
            self.manager.close()

    def leftovers(self):
        """The files in the directory besides the checkpoint(s) and the user's."""
        files = set(snapshot(self.directory)) - set(_users(self.directory))
        if self.kind == "manager":
            # Its steps, and the record of the steps its retention rules govern.
            return {f for f in files if not f.startswith("step_") and f != _format.RETENTION}
        manifest = eqx_ckpt.Checkpoint(self.directory)._manifest
        live = {manifest.data_root} if manifest.data_root else {"a", "b", "frozen", "packed.int64", "zarr.json"}
        return {f for f in files if f.split(os.sep)[0] not in live} - {"manifest.json"}


def _count(tmp_path, kind):
    scenario = _Scenario(kind, tmp_path / "count")
    scenario.prepare()
    with inject(None, Injected) as calls:
        scenario.save(2)
    scenario.close()
    return len(calls)


@pytest.mark.parametrize("kind", ["first", "overwrite", "manager"])
@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
def test_every_io_step_failing(tmp_path, kind, error):
    total = _count(tmp_path, kind)
    assert total >= 10, total
    outcomes = {"old": 0, "new": 0, "none": 0}
    old = None if kind == "first" else 1
    for k in range(total):
        scenario = _Scenario(kind, tmp_path / f"{kind}{k}")
        files = scenario.prepare()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with inject(k, error):
                raised = _raised(scenario.save, 2)
        where = f"{kind}: {error.__name__} at I/O call {k} of {total}"
        found = scenario.which([1, 2])
        assert found in (old, 2), where
        if found == 2 and raised is None:
            # Committed, and only the clean-up failed: a warning, never an error.
            assert error is Injected and any(issubclass(w.category, eqx_ckpt.CommitWarning) for w in caught), where
        elif error is KeyboardInterrupt:
            assert type(raised) is KeyboardInterrupt, f"{where}: got {raised!r}"
        else:
            assert isinstance(raised, eqx_ckpt.CheckpointError) and "injected at call" in str(raised), where
            assert found == old, f"{where}: a failed save must not commit"
        assert _unchanged(scenario.directory, files), f"{where}: the user's files changed"
        outcomes["none" if found is None else "new" if found == 2 else "old"] += 1
        # Whatever was left, the next save succeeds and clears it.
        scenario.save(3)
        assert scenario.which([3]) == 3, where
        assert scenario.leftovers() == set(), where
        assert _unchanged(scenario.directory, files), where
        scenario.close()
    print(f"{kind}, {error.__name__} at each of {total} I/O calls: {outcomes}")
    assert outcomes["new"] >= 1 and outcomes["old" if old else "none"] >= 1


# What a commit runs in the caller's thread: the transaction, and the part of
# the save that writes and commits it (the story's, and its stages').
# (The lines of `save` around it are
# `test_an_interrupt_at_every_line_around_the_commit`'s.)
_COMMIT_MODULES = ("eqx_ckpt._store._transaction",)
_COMMIT_FUNCTIONS = {
    "eqx_ckpt._save._serialise": ("_write_and_commit", "_commit", "_stop", "commit", "stop"),
}


def _counted(frame):
    module = frame.f_globals.get("__name__")
    return module in _COMMIT_MODULES or frame.f_code.co_name in _COMMIT_FUNCTIONS.get(module, ())


def _raised(call, *args):
    """What `call(*args)` raised (KeyboardInterrupt too), or `None`."""
    try:
        call(*args)
    except BaseException as e:
        return e
    return None


def _line_tracer(lines, fail_at):
    """A local trace function that appends each line it sees to `lines` and
    raises KeyboardInterrupt at line number `fail_at` (never at a `with` line;
    see `interrupt_at_line`)."""

    def local(frame, event, arg):
        if event == "line" and not linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith(
            "with "
        ):
            lines.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}:{frame.f_lineno}")
            if len(lines) - 1 == fail_at:
                raise KeyboardInterrupt(f"injected at line {fail_at} ({lines[-1]})")
        return local

    return local


@contextlib.contextmanager
def interrupt_at_line(fail_at):
    """From the manifest's write on (`Transaction.commit` handing it to the
    helper thread), count the lines of the transaction that run in this
    thread (`_counted`); line number `fail_at` raises KeyboardInterrupt, as a signal whose
    handler raises can between any two lines. (A trace function's exception is
    raised in the traced frame, and ends the tracing.)

    Not at a `with` line: there, the line event also comes between a block's
    last line and its `__exit__`, which an exception would skip (Python itself
    does not promise `__exit__` against a signal landing there)."""
    from eqx_ckpt._store import _transaction

    lines = []
    armed = []
    local = _line_tracer(lines, fail_at)

    def calls(frame, event, arg):
        if not armed and frame.f_code is _interrupts.uninterrupted.__code__:
            if frame.f_back is not None and frame.f_back.f_code is _transaction.Transaction.commit.__code__:
                armed.append(True)
                # The frames already running (the commit, the save around it) count too.
                caller = frame.f_back
                while caller is not None:
                    if _counted(caller):
                        caller.f_trace = local
                    caller = caller.f_back
        if armed and _counted(frame):
            return local
        return None

    before = sys.gettrace()  # (a coverage run's: put back, or it measures nothing after this test)
    sys.settrace(calls)
    try:
        yield lines
    finally:
        sys.settrace(before)


@pytest.mark.parametrize("kind", ["first", "overwrite"])
def test_an_interrupt_at_every_line_of_the_commit(tmp_path, kind):
    """A signal lands between two lines, not only in I/O: from the manifest's
    write on, through recording the commit and the clean-up, an interrupt at
    each line the caller's thread runs leaves the old or the new checkpoint
    whole (an interrupt that landed after the manifest was written, but before
    the save had recorded it, once made its abort delete the arrays the new
    manifest uses)."""
    scenario = _Scenario(kind, tmp_path / "count")
    scenario.prepare()
    with interrupt_at_line(None) as lines:
        scenario.save(2)
    total = len(lines)
    assert total >= 20, total
    old = None if kind == "first" else 1
    outcomes = {"old": 0, "new": 0, "none": 0}
    for k in range(total):
        scenario = _Scenario(kind, tmp_path / f"{kind}{k}")
        files = scenario.prepare()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", eqx_ckpt.CommitWarning)
            with interrupt_at_line(k) as lines:
                raised = _raised(scenario.save, 2)
        where = f"{kind}: KeyboardInterrupt at line {k} of {total} ({lines[k] if k < len(lines) else 'not reached'})"
        assert raised is None or type(raised) is KeyboardInterrupt, f"{where}: got {raised!r}"
        found = scenario.which([1, 2])
        assert found in (old, 2), where
        assert _unchanged(scenario.directory, files), where
        outcomes["none" if found is None else "new" if found == 2 else "old"] += 1
        scenario.save(3)
        assert scenario.which([3]) == 3, where
        assert scenario.leftovers() == set(), where
    print(f"{kind}, KeyboardInterrupt at each of {total} lines from the commit on: {outcomes}")
    assert outcomes["new"] >= 1


@pytest.mark.parametrize("kind", ["first", "overwrite"])
@pytest.mark.parametrize("manifest", ["its own", "unreadable"])
def test_an_abort_never_deletes_what_the_live_manifest_may_use(tmp_path, kind, manifest):
    """However a save came to abort after its manifest was written (here: the
    record of the commit lost, then an interrupt), the abort checks the live
    manifest first: when it is the save's own, or cannot be read to tell, the
    arrays stay and the journal is left for the next save."""
    from eqx_ckpt._base import _faults

    scenario = _Scenario(kind, tmp_path / kind)
    files = scenario.prepare()
    written = threading.Event()

    def forget(loc, landed):
        # Before the save records its commit: the record is lost.
        written.set()
        raise KeyboardInterrupt("after the manifest was written")

    def read_file(loc, name):
        if written.is_set() and manifest == "unreadable" and name == "manifest.json":
            raise OSError("unreadable")

    with _faults.armed({"commit.manifest_written": forget, "storage.read_file": read_file}):
        with pytest.raises(KeyboardInterrupt):
            scenario.save(2)
    assert (scenario.directory / "saving.json").exists()  # the journal, for the next save
    assert scenario.which([1, 2]) == 2
    assert _unchanged(scenario.directory, files)
    scenario.save(3)
    assert scenario.which([3]) == 3
    assert scenario.leftovers() == set()


def _around_the_commit():
    """The code a save runs in the caller's thread around its transaction: the
    entry and exit of `save`, the process's claim on the destination, the
    collector's pause, and the start of an asynchronous save's thread."""
    from eqx_ckpt._base import _gc
    from eqx_ckpt._save import _background, _serialise
    from eqx_ckpt._store import _lease

    functions = [
        _serialise.save.__wrapped__,
        _serialise._collect_and_plan,
        _background.start,
        _background.PendingSave.__init__,
        _lease.acquire_exclusive,
        _lease.Claim.__init__,
        _lease.Claim.hand_over,
        _lease.Claim.release,
        _gc.gc_paused.__wrapped__,
        _gc.GcPause.begin,
        _gc.GcPause.resume,
        _gc._settle,
    ]
    return {f.__code__ for f in functions}


@contextlib.contextmanager
def interrupt_in(codes, fail_at):
    """Count the lines that run in this thread in functions whose code is in
    `codes`; line number `fail_at` raises KeyboardInterrupt (not at `with`
    lines, as in `interrupt_at_line`)."""
    lines = []
    local = _line_tracer(lines, fail_at)
    before = sys.gettrace()  # (a coverage run's: put back, or it measures nothing after this test)
    sys.settrace(lambda frame, event, arg: local if frame.f_code in codes else None)
    try:
        yield lines
    finally:
        sys.settrace(before)


@contextlib.contextmanager
def deadline(seconds, what):
    """Fail, instead of hanging, when the block is still running after `seconds`
    (SIGALRM interrupts a wait on a lock in the main thread)."""
    import signal

    def expired(signum, frame):
        raise TimeoutError(f"{what}: still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_an_interrupt_at_every_line_around_the_commit(tmp_path, blocking):
    """The lines of `save` outside the transaction hold process-wide state: the
    claim on the destination, the collector's pause, the list of saves in
    flight. An interrupt at any of them (before the claim is kept, or just
    before it is handed back) once left the claim held, and the next save to
    that path in the process waited for ever. Now every such interrupt leaves
    a checkpoint whole, the collector as it was, and the next save in the same
    thread runs."""
    from eqx_ckpt._base import _gc
    from eqx_ckpt._save import _background
    from eqx_ckpt._store import _lease

    codes = _around_the_commit()

    def save(directory, generation):
        pending = eqx_ckpt.tree_serialise_leaves(directory, _tree(generation), blocking=blocking)
        if pending is not None:
            pending.wait()

    eqx_ckpt.tree_serialise_leaves(tmp_path / "count", _tree(1))
    with interrupt_in(codes, None) as lines:
        save(tmp_path / "count", 2)
    total = len(lines)
    assert total >= 30, lines
    interrupted = 0
    for k in range(total):
        directory = tmp_path / f"at{k}"
        eqx_ckpt.tree_serialise_leaves(directory, _tree(1))
        with interrupt_in(codes, k):
            raised = _raised(save, directory, 2)
        where = f"KeyboardInterrupt at line {k} of {total} ({lines[k]})"
        assert raised is None or type(raised) is KeyboardInterrupt, f"{where}: got {raised!r}"
        interrupted += raised is not None
        with deadline(60, f"{where}: the next save"):
            for p in list(_background._PENDING):
                p.wait()  # a save the interrupt left running in the background
            claim = _lease.holder(_location.location(directory))
            assert claim is None or claim.thread == threading.get_ident(), where
            try:
                save(directory, 3)
            except Exception as e:
                raise AssertionError(f"{where}: the next save failed: {e}") from e
        assert _holds(directory, 3), where
        assert _lease.holder(_location.location(directory)) is None, where
        assert not _gc._active and gc.isenabled(), f"{where}: the collector was left paused"
        assert not (directory / "saving.json").exists(), where
    assert interrupted >= total - 3, (interrupted, total)


def test_an_interrupt_at_every_line_of_a_manager_save(tmp_path):
    """The same over a `CheckpointManager.save` (with its retention), from the
    scan of the directory to the deletion of the step it no longer keeps: after
    each interrupt, every step left is whole, and the next save runs and
    leaves only itself."""
    from eqx_ckpt._manage import _manager, _retention, _steps

    manager_functions = [
        _manager.CheckpointManager.save,
        _manager.CheckpointManager._undo,
        _manager.CheckpointManager._apply_retention,
        _retention.Retention.begin,
        _retention.Retention.apply,
        _steps.delete_step,
    ]
    codes = _around_the_commit() | {f.__code__ for f in manager_functions}
    scenario = _Scenario("manager", tmp_path / "count")
    scenario.prepare()
    with interrupt_in(codes, None) as lines:
        scenario.save(2)
    scenario.close()
    total = len(lines)
    assert total >= 60, lines
    for k in range(total):
        scenario = _Scenario("manager", tmp_path / f"at{k}")
        files = scenario.prepare()
        with interrupt_in(codes, k):
            raised = _raised(scenario.save, 2)
        where = f"KeyboardInterrupt at line {k} of {total} ({lines[k]})"
        assert raised is None or type(raised) is KeyboardInterrupt, f"{where}: got {raised!r}"
        assert scenario.which([1, 2]) in (1, 2), where
        assert _unchanged(scenario.directory, files), where
        with deadline(60, f"{where}: the next save"):
            try:
                scenario.save(3)
            except Exception as e:
                raise AssertionError(f"{where}: the next save failed: {e}") from e
        assert scenario.which([3]) == 3, where
        assert scenario.leftovers() == set(), where
        scenario.close()


def _functions_of(*modules):
    """The code of every function and method defined in `modules`."""
    codes = set()
    for module in modules:
        for value in vars(module).values():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if isinstance(value, types.FunctionType):
                codes.add(inspect.unwrap(value).__code__)
            elif isinstance(value, type):
                codes |= {m.__code__ for m in vars(value).values() if isinstance(m, types.FunctionType)}
    return codes


@pytest.mark.parametrize("source", ["checkpoint", "published"])
def test_an_interrupt_at_every_line_of_a_load(tmp_path, source):
    """A load holds process-wide state too (the collector's pause, reads in
    flight in the read window; of a published folder, runs hashed as they are
    read): an interrupt at any line of the load's modules leaves the collector
    as it was, and the next load returns the checkpoint."""
    from eqx_ckpt._base import _gc, _tree as tree_module
    from eqx_ckpt._foreign import _safetensors
    from eqx_ckpt._load import _deserialise, _load_plan, _load_report, _read, _reader
    from eqx_ckpt._ondisk import _digests
    from eqx_ckpt._sources import _verified
    from eqx_ckpt._store import _window

    modules = [_deserialise, _load_plan, _load_report, _window, tree_module, _gc, _read, _local_read, _memory, _pack]
    if source == "published":  # (what its load runs in this thread)
        modules += [_reader, _safetensors, _verified, _digests]
    codes = _functions_of(*modules, _storage)
    directory = tmp_path / "ckpt"
    save = eqx_ckpt.export_safetensors if source == "published" else eqx_ckpt.tree_serialise_leaves
    save(directory, _tree(1))
    eqx_ckpt.tree_deserialise_leaves(directory, _tree(0))  # as every load after it: caches filled
    with interrupt_in(codes, None) as lines:
        eqx_ckpt.tree_deserialise_leaves(directory, _tree(0))
    total = len(lines)
    assert total >= 500, total
    interrupted = 0
    for k in range(total):
        with interrupt_in(codes, k):
            raised = _raised(eqx_ckpt.tree_deserialise_leaves, directory, _tree(0))
        where = f"KeyboardInterrupt at line {k} of {total} ({lines[k]})"
        assert raised is None or type(raised) is KeyboardInterrupt, f"{where}: got {raised!r}"
        interrupted += raised is not None
        loaded = eqx_ckpt.tree_deserialise_leaves(directory, _tree(0))
        assert tree_equal(loaded, _tree(1), typematch=True), where
        assert not _gc._active and gc.isenabled(), f"{where}: the collector was left paused"
    assert interrupted >= total - 3, (interrupted, total)


def test_a_save_to_the_same_path_from_a_progress_callback_is_refused(tmp_path):
    """A save nested in a save's progress callback, to the same path, takes the
    thread's claim over and is refused by the lease at once (it used to wait
    for ever); the outer save commits."""
    refused = []

    def progress(*counts):
        if not refused:
            with pytest.raises(eqx_ckpt.CheckpointExistsError, match="in this process") as info:
                eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(3))
            refused.append(info.value)

    with deadline(60, "the nested save"):
        eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(2), progress=progress)
    assert len(refused) == 1 and _holds(tmp_path, 2)
    eqx_ckpt.tree_serialise_leaves(tmp_path, _tree(4))
    assert _holds(tmp_path, 4)
