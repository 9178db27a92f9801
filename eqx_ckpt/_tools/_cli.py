"""`eqx-ckpt`: inspect, verify and compare checkpoints; run the demo.

The CLI only parses and formats: every command calls a public library function.
Exit codes: 0 success (for `verify`: sound; for `diff`: equal), 1 `verify`
found damage or `diff` found differences, 2 an error (bad path, not a
checkpoint, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import __version__
from .._base._errors import CheckpointError, CheckpointNotFoundError, CheckpointValueError, from_file
from .._base._location import Location, location
from .._load import _source
from .._load._checkpoint import SMALL_VALUES, Checkpoint, human
from .._manage._manager import CheckpointManager
from .._ondisk._format import MANIFEST
from .._store import _share
from ._demo import run
from ._diff import diff
from ._export import export_safetensors
from ._verify import Problems, verify


def _path(text: str) -> Any:
    """A path, URL, or (starting with `{`) a TensorStore kvstore spec as JSON, for
    object stores that need an endpoint or credentials options."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise CheckpointValueError(f"{text!r} starts with '{{' but is not a JSON kvstore spec: {e}") from None
    return text


def printable(text: str) -> str:
    """`text` with terminal control characters (and other unprintable ones)
    escaped, so that a hostile manifest cannot drive the terminal."""
    return "\n".join(
        "".join(char if char.isprintable() else repr(char)[1:-1] for char in line) for line in text.split("\n")
    )


def _ls(args: argparse.Namespace) -> int:
    path = _path(args.path)
    try:
        ckpt = Checkpoint(path)
    except CheckpointNotFoundError as missing:
        try:
            manager = CheckpointManager(path)
        except CheckpointValueError:  # a file: no manager's directory either
            raise missing from None
        steps = manager.all_steps()
        if not steps:
            raise
        print(_format_steps(manager, steps))
        return 0
    if args.types:
        print(printable(_format_types(ckpt)))
        return 0
    print(printable(ckpt.listing(depth=args.depth, values=args.values)))
    return 0


def _format_types(ckpt: Checkpoint) -> str:
    """The classes and functions a load without `like` builds, those outside the
    default trust marked, and the `trust=[...]` they need."""
    untrusted = ckpt.types(trust=[])
    lines, needed = [], []
    for name, paths in ckpt.types().items():
        python = from_file(name.replace(":", "."))  # a name from the file: one line, bounded
        if name in untrusted:
            needed.append(python)
        shown = ", ".join(from_file(p) or "(the root)" for p in paths[:3]) + (
            f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        )
        lines.append(f"{python}  {'(needs trust)' if name in untrusted else '(trusted by default)'}  at {shown}")
    if needed:
        lines.append(f"Checkpoint(path).load(trust=[{', '.join(needed)}]) rebuilds it (import them first).")
    else:
        lines.append("Checkpoint(path).load(trust=[]) rebuilds it: every class and function is trusted by default.")
    return "\n".join(lines)


def _format_steps(manager: CheckpointManager, steps: list[int]) -> str:
    """A manager's directory: its committed steps, each with its size and metrics."""
    rows = []
    for step in steps:
        ckpt = Checkpoint(manager.step_path(step))
        metrics = ", ".join(f"{name}={value}" for name, value in sorted(manager.metrics(step).items()))
        rows.append((f"step {step}", f"{len(ckpt)} leaves", human(ckpt.total_bytes), metrics))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.append(
        f"{len(steps)} steps in a CheckpointManager directory; `eqx-ckpt ls {manager.step_path(steps[-1])}` lists one"
    )
    return printable("\n".join(lines))


def _info(args: argparse.Namespace) -> int:
    ckpt = Checkpoint(_path(args.path))
    print(f"path:            {printable(ckpt.path)}")
    if ckpt.format == "eqx_ckpt":
        print(f"format:          eqx_ckpt {ckpt.format_version} (zarr v3 arrays, {MANIFEST})")
    else:
        print(f"format:          {ckpt.format}")
    print(f"layout:          {ckpt.layout}")
    # Other formats record neither: their lines are left out, not printed empty.
    if ckpt.library_version:
        print(f"library version: {printable(ckpt.library_version)}")
    if ckpt.created:
        print(f"created:         {printable(ckpt.created)}")
    for key, value in ckpt.metadata.items():
        print(f"metadata:        {printable(key)}={printable(value)}")
    print(f"leaves:          {len(ckpt)}")
    print(f"bytes:           {ckpt.total_bytes} ({human(ckpt.total_bytes)})")
    if ckpt.format == "eqx_ckpt":
        shared = _shared_files(location(_path(args.path)))
        if shared is not None:
            count, nbytes = shared
            print(f"shared:          {count} files, {human(nbytes)}, also used by other checkpoints or steps")
    return 0


def _shared_files(loc: Location) -> tuple[int, int] | None:
    """The files (and bytes) of the checkpoint at `loc` that other checkpoints
    or steps also use (`_share.shared_files`); `None` where files are never
    shared (not on a local disk, the OCDBT layout)."""
    if loc.local is None:
        return None
    source = _source.checkpoint(loc)
    if source is None or source.manifest.layout != "directories":
        return None
    return _share.shared_files(source.data.local or loc.local)


def _verify(args: argparse.Namespace) -> int:
    problems = verify(_path(args.path))
    args.code = 1 if problems else 0  # the answer, even if the reader goes away (`main`)
    if problems.steps:
        print(printable(_format_verified_steps(args.path, problems)))
        return args.code
    for problem in problems:
        print(printable(str(problem)))
    for limit in problems.unchecked:
        print(f"not checked: {limit}")
    print(f"{args.path}: {'sound' if not problems else f'{len(problems)} problem(s)'}")
    return args.code


def _format_verified_steps(path: str, problems: Problems) -> str:
    """A manager's directory verified: each step's problems (or `sound`), then
    the steps that are damaged."""
    lines = []
    for step in problems.steps:
        own = [problem for problem in problems if problem.step == step]
        lines += [str(problem) for problem in own]
        lines.append(f"step {step}: {f'{len(own)} problem(s)' if own else 'sound'}")
    lines += [f"not checked: {limit}" for limit in problems.unchecked]
    damaged = sorted({problem.step for problem in problems if problem.step is not None})
    verdict = f"{len(damaged)} damaged: {damaged}" if damaged else "sound"
    lines.append(f"{path}: {len(problems.steps)} steps in a CheckpointManager directory, {verdict}")
    return "\n".join(lines)


def _diff(args: argparse.Namespace) -> int:
    differences = diff(_path(args.a), _path(args.b))
    args.code = 1 if differences else 0
    for line in differences:
        print(printable(line))
    if not differences:
        print(
            f"{printable(args.a)} and {printable(args.b)} are equal: the same leaves, dtypes, shapes, values "
            f"and structure."
        )
    return args.code


def _demo(args: argparse.Namespace) -> int:
    return run(args.dir, steps=args.steps)


def _export(args: argparse.Namespace) -> int:
    rules: list[tuple[str, str | None]] = []
    for rule in args.rename:
        pattern, sep, replacement = rule.partition("=")
        rules.append((pattern, replacement if sep else None))
    metadata: dict[str, str] = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CheckpointValueError(f"`--metadata {item}` must be KEY=VALUE, e.g. `--metadata format=pt`.")
        if metadata.get(key, value) != value:
            raise CheckpointValueError(f"`--metadata` gives {key!r} twice ({metadata[key]!r} and {value!r}).")
        metadata[key] = value
    written = export_safetensors(
        _path(args.out), Checkpoint(_path(args.ckpt)), max_shard_size=args.max_shard_size,
        rename=rules or None, metadata=metadata or None,
    )  # fmt: skip
    for name in written:
        print(name)
    return 0


# The one way the CLI reaches an S3-compatible server (docs/storage.md says the same).
STORAGE_HELP = (
    "An S3-compatible server (MinIO, Ceph, a local test server): set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) "
    "to its URL, e.g. http://127.0.0.1:9000, with the usual AWS credentials variables, and pass s3://bucket/path. "
    "Other kvstore options (credentials, retries such as s3_request_retries): pass the path as a TensorStore "
    'kvstore spec in JSON, e.g. \'{"driver": "s3", "bucket": "my-bucket", "path": "run/ckpt/", "s3_request_retries": '
    '{"max_retries": 20}}\'. Storage that cannot be reached fails within seconds (exit 2).'
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="eqx-ckpt",
        description="Inspect, verify and compare eqx_ckpt checkpoints. Exit codes: 0 ok "
        "(verify: sound, diff: equal), 1 verify found damage / diff found differences, 2 error.",
    )
    top.add_argument("--version", action="version", version=f"eqx-ckpt {__version__}")
    commands = top.add_subparsers(dest="command", required=True)
    ls = commands.add_parser("ls", help="sorted tree of keys with dtype[shape] and size", epilog=STORAGE_HELP)
    ls.add_argument("path", help="checkpoint directory, kvstore URL, or kvstore spec as JSON")
    ls.add_argument("--depth", type=int, default=None, help="show only this many levels")
    ls.add_argument("--values", action="store_true", help=f"print leaves of at most {SMALL_VALUES} elements")
    ls.add_argument(
        "--types", action="store_true", help="the classes and functions a load without `like` needs trusted"
    )
    ls.set_defaults(run=_ls)
    info = commands.add_parser(
        "info", help="format and library version, creation time, leaf count, bytes", epilog=STORAGE_HELP
    )
    info.add_argument("path", help="checkpoint directory, kvstore URL, or kvstore spec as JSON")
    info.set_defaults(run=_info)
    verify = commands.add_parser(
        "verify", help="read and check every byte (of other formats: what they can be checked for); exit 0 sound, "
        "1 damaged", epilog=STORAGE_HELP,
    )  # fmt: skip
    verify.add_argument("path", help="checkpoint, .safetensors file, Hugging Face or orbax directory, kvstore URL")
    verify.set_defaults(run=_verify)
    diff = commands.add_parser(
        "diff", help="compare two checkpoints; exit 0 equal, 1 different, 2 error", epilog=STORAGE_HELP
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.set_defaults(run=_diff)
    export = commands.add_parser(
        "export", help="write a checkpoint as (Hugging Face sharded) safetensors", epilog=STORAGE_HELP
    )
    export.add_argument("ckpt", help="checkpoint directory, kvstore URL, or kvstore spec as JSON")
    export.add_argument("out", help="output directory (or a path ending in .safetensors for one file)")
    export.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format")
    export.add_argument("--max-shard-size", default="5GB", help="bytes per shard, e.g. 5GB, 500MB (default 5GB)")
    export.add_argument(
        "--rename", action="append", default=[], metavar="PATTERN[=REPLACEMENT]",
        help="regex rule from dotted path to tensor name (repeatable, first match wins); a PATTERN alone leaves "
        "the matching leaves out",
    )  # fmt: skip
    export.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE",
        help="a string for each file's __metadata__, e.g. format=pt (repeatable)",
    )  # fmt: skip
    export.set_defaults(run=_export)
    demo = commands.add_parser("demo", help="train a small model, save, list and reload it")
    demo.add_argument("--dir", default=None, help="where to save (default: a new temporary directory)")
    demo.add_argument("--steps", type=int, default=50, help="training steps")
    demo.set_defaults(run=_demo)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run `eqx-ckpt` with `argv`; returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        code: Any = args.run(args)
    except CheckpointError as e:
        print(f"eqx-ckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (`| head`) went away; that is not an error of ours. The
        # answer stands: `verify` found damage, `diff` differences (`args.code`).
        sys.stdout = open(os.devnull, "w")
        return int(getattr(args, "code", 0))
    except OSError as e:
        print(f"eqx-ckpt {args.command}: {e}", file=sys.stderr)
        return 2
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
