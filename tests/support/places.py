"""Where things are, for tests in any folder of tests/ and the helpers beside this file."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # shared helpers and the scripts tests run as processes (on `sys.path`)
FIXTURES = TESTS / "fixtures"  # checkpoints every earlier format wrote
