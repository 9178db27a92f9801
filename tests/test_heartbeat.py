"""The heartbeat of a multi-process save (`_multihost._Heartbeat`) ends before
the interpreter finalises: a beat still inside the coordination client's call
at finalisation was ended inside that C++ call, and aborted a process at exit
("FATAL: exception not rethrown") after all its saves had succeeded."""

import pathlib
import subprocess
import sys
import textwrap

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
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, cwd=root, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    # The beat in flight when the main thread ended came back, and before finalisation.
    assert lines == ["main thread exits", "beat 1 returned; finalising: False"], lines
