"""The heartbeat of a multi-process save (`_multihost._Heartbeat`) ends before
the interpreter finalises: a beat still inside the coordination client's call
at finalisation was ended inside that C++ call, and aborted a process at exit
("FATAL: exception not rethrown") after all its saves had succeeded."""

import subprocess
import sys
import textwrap

import places

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from eqx_ckpt._hosts import _multihost

    _multihost.HEARTBEAT_SECONDS = 0.01
    log = open(sys.argv[1], "w", buffering=1)
    inside = threading.Event()

    class SlowClient:
        # A key-value call that takes a while, as one does with eight processes on two cores.
        def key_value_set(self, key, value, allow_overwrite):
            if value == "0":
                return
            inside.set()
            time.sleep(0.5)
            log.write(f"beat {value} returned; finalising: {sys.is_finalizing()}\\n")

    _multihost._Heartbeat.start(SlowClient(), 3)
    inside.wait(5)
    log.write("main thread exits\\n")
    """
)


def test_a_beat_in_flight_at_exit_returns_before_the_interpreter_finalises(tmp_path):
    script, log = tmp_path / "beat.py", tmp_path / "log.txt"
    script.write_text(SCRIPT)
    root = places.ROOT
    done = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, cwd=root, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    # The beat in flight when the main thread ended came back, and before finalisation.
    assert lines == ["main thread exits", "beat 1 returned; finalising: False"], lines


def test_the_heartbeat_thread_ends_in_a_process_without_jax_distributed(tmp_path):
    """The heartbeat thread starts when eqx_ckpt is imported (a process may die
    before its first save, and must be named), and waits for
    `jax.distributed`; once JAX's backend has started without it (it can then
    never start), the thread ends: a single-process program keeps no thread
    of eqx_ckpt's."""
    script = tmp_path / "alone.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, time
            import jax.numpy as jnp
            import eqx_ckpt

            names = lambda: [t.name for t in threading.enumerate()]
            print("imported", "eqx_ckpt-heartbeat" in names())
            jnp.zeros(3).block_until_ready()  # the backend starts, without jax.distributed
            deadline = time.monotonic() + 30
            while "eqx_ckpt-heartbeat" in names() and time.monotonic() < deadline:
                time.sleep(0.1)
            print("after the backend started", "eqx_ckpt-heartbeat" in names())
            """
        )
    )
    root = places.ROOT
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["imported True", "after the backend started False"], done.stdout


def test_a_forked_child_watches_for_itself_unless_its_parent_had_joined_jax_distributed(tmp_path):
    """A fork carries no thread over. A child forked after the import (a data
    loader's worker, a pre-forking server's child) starts a heartbeat of its
    own, so that it can join a `jax.distributed` job and be named if it dies
    there; a child of a process that had joined one starts none, and never
    beats with its parent's client as its parent."""
    script = tmp_path / "forked.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, socket, threading
            import eqx_ckpt, jax

            names = lambda: [t.name for t in threading.enumerate() if t.name.startswith("eqx_ckpt")]

            def in_a_child():
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.write(write, repr(names()).encode())
                    os._exit(0)
                os.waitpid(pid, 0)
                return os.read(read, 1000).decode()

            print("parent", names())
            print("child", in_a_child())
            with socket.socket() as free:
                free.bind(("localhost", 0))
                port = free.getsockname()[1]
            jax.distributed.initialize(f"localhost:{port}", num_processes=1, process_id=0)
            print("child of a joined process", in_a_child())
            jax.distributed.shutdown()
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=places.ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "parent ['eqx_ckpt-heartbeat']",
        "child ['eqx_ckpt-heartbeat']",
        "child of a joined process []",
    ], done.stdout
