"""The tests' own layout (tests/README.md): every test file is in a folder
the map names, no test module imports another, and every file the move of
issue 89 names (`tests/support/moved.py`) is where it says."""

import ast
import re

import moved
import places

FOLDERS = re.findall(r"^\| `(\w+)/` \|", (places.TESTS / "README.md").read_text(), re.M)


def _test_files() -> list:
    return sorted(p for p in places.TESTS.rglob("test_*.py") if "fixtures" not in p.parts)


def test_every_test_file_is_in_a_folder_the_map_names():
    assert len(FOLDERS) >= 14  # the table is still found
    placed = {p.relative_to(places.TESTS).parts[0] for p in _test_files()}
    assert all(len(p.relative_to(places.TESTS).parts) == 2 for p in _test_files())
    assert placed == set(FOLDERS)


def test_no_test_module_imports_another():
    names = {p.stem for p in _test_files()}
    for path in _test_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported = {node.module.split(".")[0]}
            else:
                continue
            # (a test's own child process may import its own module by path)
            assert not (imported & names) - {path.stem}, f"{path.relative_to(places.ROOT)} imports a test module"


def test_the_move_table_names_every_test_file_where_it_is():
    assert set(moved.MOVED.values()) <= {str(p.relative_to(places.TESTS)) for p in _test_files()}
    for old, new in moved.MOVED.items():
        assert (places.TESTS / new).is_file(), new
        assert not (places.TESTS / old).exists(), old
    for new in moved.REPLACED.values():
        file, _, name = new.partition("::")
        assert re.search(rf"def {re.escape(name.split('[')[0].split('::')[-1])}\b", (places.ROOT / file).read_text())
