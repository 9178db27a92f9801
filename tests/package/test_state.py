"""The owner of the process's registries and memos (`eqx_ckpt._base._state`):
each table keeps its bound as its eviction says, `reset` empties them, and a
forked child starts without the parent's threads, pools and saves."""

import os
import re
import subprocess
import sys
import textwrap

import places
import pytest

from eqx_ckpt._base import _state


@pytest.fixture
def made():
    """`made(name, bound, evict)`: a table of the test's own, forgotten after it."""
    names = []

    def make(name, bound, evict, **options):
        names.append(f"test.{name}")
        return _state.table(f"test.{name}", bound, evict, **options)

    yield make
    _state._TABLES[:] = [t for t in _state._TABLES if t.name not in names]


def test_each_eviction_keeps_its_bound(made):
    clear, oldest, lru, refuse = (made(e, 3, e) for e in ("clear", "oldest", "lru", "refuse"))
    for table in (clear, oldest, lru, refuse):
        for key in "abc":
            table.put(key, key.upper())
    assert lru.recent("a") == "A" and lru.recent("z") is None
    for table in (clear, oldest, lru):
        table.put("d", "D")
    assert list(clear) == ["d"]
    assert list(oldest) == ["b", "c", "d"]
    assert list(lru) == ["c", "a", "d"]  # `b` was the least recently used
    with pytest.raises(RuntimeError, match=re.escape("'test.refuse' is full")):
        refuse.put("d", "D")
    refuse.put("a", "again")  # a key it holds takes no room
    assert len(refuse) == 3


def test_a_table_needs_a_name_of_its_own_and_a_bound_unless_live(made):
    made("named", 1, "clear")
    with pytest.raises(ValueError, match="needs a name of its own"):
        made("named", 1, "clear")
    with pytest.raises(ValueError, match="a bound unless it is live"):
        made("unbounded", None, "clear")
    with pytest.raises(ValueError, match="a bound unless it is live"):
        made("bounded", 3, "live")


def test_reset_empties_the_tables_named_or_every_table_and_memo(made):
    one, two = made("one", 4, "clear"), made("two", 4, "clear")
    one.put(1, 1), two.put(2, 2)
    _state.reset("test.one")
    assert one == {} and two == {2: 2}
    with pytest.raises(ValueError, match=r"No table is named \['test.three'\]"):
        _state.reset("test.three")


def test_every_table_of_the_package_is_bounded_or_live():
    import eqx_ckpt  # noqa: F401  (every module, so every table)

    for table in _state._TABLES:
        assert (table.bound is None) == (table.evict == "live"), table.name
        assert table.evict in ("clear", "oldest", "lru", "refuse", "live") and table.fork in ("keep", "empty")


def test_a_forked_child_has_none_of_its_parents_workers_and_no_lock_left_held():
    """A child forked while another thread held a table's lock, with pools of
    the parent's workers, gets fresh locks and pools that start their own."""
    code = textwrap.dedent(
        """
        import os, threading, warnings
        import jax.tree_util as jtu
        import eqx_ckpt
        from eqx_ckpt._base import _keypath, _state, _threads
        _threads.pool("eqx_ckpt-read", 2).submit(lambda: None).result()
        _keypath.remembered_record(jtu.GetAttrKey("a"))
        held, release = threading.Event(), threading.Event()
        def hold():
            with _threads._POOLS.lock:
                held.set()
                release.wait()
        threading.Thread(target=hold).start()
        held.wait()
        warnings.simplefilter("ignore")  # (JAX warns that a fork of a threaded process may deadlock)
        child = os.fork()
        if child == 0:
            pools = len(_threads._POOLS)
            ran = _threads.pool("eqx_ckpt-read", 2).submit(lambda: 7).result(timeout=10)
            os._exit(0 if (pools, ran, len(_keypath._RECORDS) > 0) == (0, 7, True) else 1)
        release.set()
        print("child:", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(places.ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "child: 0" in done.stdout, done.stdout + done.stderr[-3000:]
