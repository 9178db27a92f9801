"""Where things are, for tests in any folder of tests/ and the helpers beside this file."""

import pathlib
import socket

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # shared helpers and the scripts tests run as processes (on `sys.path`)
FIXTURES = TESTS / "fixtures"  # checkpoints every earlier format wrote


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (for a `jax.distributed` coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
