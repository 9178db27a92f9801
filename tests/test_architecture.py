"""The architecture the code promises (docs/architecture.md), checked on the code
itself so it cannot drift: the on-disk names and sizes live in `_format`, only the
storage seam imports `tensorstore`, no module imports another that imports it
back, and every module is on the contributor's map."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "eqx_ckpt"
MODULES = sorted(PACKAGE.glob("*.py"))

# Names of files and folders a checkpoint or a manager's run holds (see
# `_format`): a string that holds one of these and no space is a file name, not
# a message. Any `.json` file counts, except a foreign format's own names (the
# safetensors index, which `_safetensors` owns); a chunk key is `c`, `c/...` or
# `.../c` (a bare `"c"` is caught by `_CHUNK_FOLDER_USES`).
_ON_DISK = re.compile(
    r"manifest\.json|saving\.json|zarr\.json|ocdbt\.db|\.__lock|^gen\.|^packed\.|^step_|\.metrics\.json"
    r"|(?<!safetensors\.index)\.json$|(^|/)c/|/c$"
)
# The size of a chunk's checksum is `_format.CHECKSUM_BYTES`, never a literal 4
# added to or taken from a size or an offset.
_CHECKSUM = 4


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _imports(tree: ast.Module) -> set[str]:
    """The eqx_ckpt modules `tree` imports at run time, at any depth (inside
    functions too), leaving out imports under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 1:
                targets = [child.module] if child.module else [alias.name for alias in child.names]
                found.update(t for t in targets if (PACKAGE / f"{t}.py").exists())
            visit(child)

    visit(tree)
    return found


def _not_a_chunk_folder(tree: ast.Module) -> set[int]:
    """The bare `"c"` strings of `tree` that cannot name a chunk file: a dict's
    key, a subscript, a set's member, a comparison's operand (a dtype's kind),
    or the key of `.get`. Any other `"c"` (joined into a path, returned, added
    to a set of names) is the chunk folder, which `_format.CHUNKS` names."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found.update(id(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            found.add(id(node.slice))
        elif isinstance(node, ast.Set):
            found.update(id(e) for e in node.elts)
        elif isinstance(node, ast.Compare):
            found.update(id(e) for e in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            found.update(id(a) for a in node.args[:1])
    return found


def _on_disk_literals(path: pathlib.Path) -> list[str]:
    tree = _tree(path)
    docstrings, not_chunks = _docstrings(tree), _not_a_chunk_folder(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            name = node.value
            if not re.search(r"\s", name) and (_ON_DISK.search(name) or (name == "c" and id(node) not in not_chunks)):
                found.append(f"{path.name}:{node.lineno}: {name!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            if any(isinstance(side, ast.Constant) and side.value == _CHECKSUM for side in (node.left, node.right)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)!r} (a checksum's size?)")
    return found


def test_on_disk_names_live_in_the_format_module():
    misplaced = [found for path in MODULES if path.name != "_format.py" for found in _on_disk_literals(path)]
    assert misplaced == [], "on-disk names and sizes belong in eqx_ckpt/_format.py:\n" + "\n".join(misplaced)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_only_the_storage_seam_imports_tensorstore(path):
    imported = any(
        (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tensorstore" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tensorstore")
        for node in ast.walk(_tree(path))
    )
    assert imported == (path.name in ("_storage.py", "_location.py"))


def test_no_import_cycles():
    graph = {path.stem: _imports(_tree(path)) for path in MODULES}
    cycles = []

    def walk(module: str, stack: list[str], done: set[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in stack:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in done:
                walk(target, [*stack, target], done)
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            walk(module, [module], done)
    assert cycles == []


def test_every_module_is_on_the_contributors_map():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [path.stem for path in MODULES if not path.stem.startswith("__") and f"`{path.stem}`" not in text]
    assert missing == [], f"docs/architecture.md does not say what these modules own: {missing}"


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code in a function's body: no docstring, blank line or comment."""
    body = function.body
    start = body[0].lineno
    if (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        start = (body[0].end_lineno or start) + 1
    inside = lines[start - 1 : function.end_lineno]
    return sum(1 for line in inside if line.strip() and not line.strip().startswith("#"))


def test_every_function_reads_in_one_screen():
    """No function runs past 60 lines of code (STYLE.md: a step of a story is one
    named function; a longer one is several steps)."""
    long = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node, lines) > 60:
                long.append(f"{path.name}: {node.name} ({_code_lines(node, lines)} lines)")
    assert long == []
