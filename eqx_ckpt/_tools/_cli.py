"""`eqx-ckpt`: inspect, verify and compare checkpoints; run the demo.

The CLI only parses and formats: every command calls a public library
function. Exit codes (the README's table of commands has each): 0 success,
1 `verify` found damage or `diff` differences, 2 an error (a checkpoint of a
newer format too: no damage, but not checked), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted_while_starting(signum: int, frame: Any) -> None:
    """Ctrl-C during the imports below: one line and exit 130, as `main` ends a command."""
    print("eqx-ckpt: interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # at once: nothing has begun that needs finishing


# The imports below (JAX's among them) take a second or two. A Ctrl-C there
# printed a traceback from inside them, or an error blaming jaxlib's extension
# (issue 88): while they run, it ends the process at once (nothing has begun
# that needs finishing). Only in the main thread and over Python's own handler,
# which is back once they are done: a process importing this module with a
# handler of its own keeps it. (`import eqx_ckpt` imports no JAX, so these
# imports are the command's start-up.)
_STARTING = (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
)
if _STARTING:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
try:
    import _thread
    import argparse
    import contextlib
    import json
    import time
    from collections.abc import Iterator, Sequence
    from typing import Any

    from .. import _PROGRAM, __version__
    from .._base import _threads
    from .._base._errors import CheckpointError, CheckpointNotFoundError, CheckpointValueError, command_line, from_file
    from .._base._location import HUB_SCHEME, Location, location
    from .._load._checkpoint import SMALL_VALUES, Checkpoint, human
    from .._load._rebuild import unrecordable_error
    from .._manage._manager import CheckpointManager
    from .._manage._retention import recorded_best
    from .._ondisk._format import MANIFEST, step_name
    from .._ondisk._iterators import IteratorRecord
    from .._sources import _source, _verified
    from .._store import _share
    from ._demo import run
    from ._diff import diff
    from ._export import ExportOptions, export
    from ._merge import merge
    from ._merge_methods import METHODS
    from ._publish import PushOptions, publish
    from ._verify import Problem, Problems, verify
finally:
    if _STARTING:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
        ckpt = Checkpoint(path, token=args.token, base=_with_base(args))
    except CheckpointNotFoundError as missing:
        manager, steps = _manager_steps(args.path, missing, args.local)
        if not (args.types or args.values or args.depth is not None):
            print(_format_steps(args.path, manager, steps))
            return 0
        # What was asked of one checkpoint: of the latest step, said so (it was ignored).
        latest = _step_path(args.path, manager, steps[-1])
        print(printable(f"{_describe_steps(args.path, steps)}; the latest, {latest}:"))
        ckpt = Checkpoint(manager.step_path(steps[-1]))
    if args.types:
        print(printable(_format_types(ckpt)))
        return 0
    print(printable(ckpt.listing(depth=args.depth, values=args.values)))
    return 0


def _manager_steps(
    given: str, error: CheckpointNotFoundError, local: str | None = None
) -> tuple[CheckpointManager, list[int]]:
    """The manager's directory at `given`, where there is no checkpoint, and
    its committed steps (with its local tier, `--local`: the steps of both);
    else `error`, that there is no checkpoint."""
    if given.startswith(HUB_SCHEME):  # a Hub repository is no manager's directory
        raise error from None
    try:
        manager = CheckpointManager(_path(given), local=local)
    except CheckpointValueError:  # a file: no manager's directory either
        if local is not None:
            raise
        raise error from None
    steps = manager.all_steps()
    if not steps:
        raise error from None
    return manager, steps


def _describe_steps(given: str, steps: list[int]) -> str:
    """`given`: a manager's directory, and its steps (a long list cut short)."""
    return f"{given} is a CheckpointManager directory of {_count(len(steps), 'step')} ({_shown(steps)})"


def _shown(steps: list[int]) -> str:
    """Steps, a long list cut short."""
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def _step_path(given: str, manager: CheckpointManager, step: int) -> str:
    """A step's path, below the directory as the user gave it (a relative
    path stays relative), else as the manager names it (a URL)."""
    if manager.local is not None and step in manager.tier_steps()["local"]:
        return os.path.join(manager.local, step_name(step))
    if given.lstrip().startswith("{") or "://" in given:
        return manager.step_path(step)
    return os.path.join(given, step_name(step))


def _format_types(ckpt: Checkpoint) -> str:
    """What a load without `like` builds (marking what needs trust), the parts
    the save could not record, and what such a load says."""
    untrusted = ckpt.types(trust=[])
    lines, needed = [], []
    for name, paths in ckpt.types().items():
        python = from_file(name.replace(":", "."))  # a name from the file: one line, bounded
        if name in untrusted and _trusted_as(name) not in needed:
            needed.append(_trusted_as(name))
        shown = ", ".join(from_file(p) or "(the root)" for p in paths[:3]) + (
            f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        )
        lines.append(f"{python}  {'(needs trust)' if name in untrusted else '(trusted by default)'}  at {shown}")
    parts = ckpt.unrecordable()
    for path, why in list(parts.items())[:_SHOWN_PROBLEMS]:
        lines.append(f"not recorded: {path or '(the root)'}  ({why}: the save could not record it as data)")
    if len(parts) > _SHOWN_PROBLEMS:
        lines.append(f"not recorded: ... and {len(parts) - _SHOWN_PROBLEMS} more parts")
    trust = f"trust=[{', '.join(needed)}]"
    if parts:
        first, why = next(iter(parts.items()))
        lines.append(
            f"Checkpoint(path).load({trust}) cannot rebuild it: it raises CheckpointValueError: "
            f"{unrecordable_error(ckpt.path, first, why)}"
        )
    elif needed:
        lines.append(f"Checkpoint(path).load({trust}) rebuilds it (import them first).")
    else:
        lines.append("Checkpoint(path).load(trust=[]) rebuilds it: every class and function is trusted by default.")
    return "\n".join(lines)


def _trusted_as(name: str) -> str:
    """What `trust=[...]` names for the recorded `module:qualname`: the class
    or function itself, or where its module is private to a package
    (`optax._src.base`), that package (`optax`), which trusts what is defined
    in it and below, as its users import it."""
    module, _, _ = name.partition(":")
    parts = module.split(".")
    private = next((i for i, part in enumerate(parts) if part.startswith("_")), None)
    if private is None or private == 0:
        return from_file(name.replace(":", "."))
    return from_file(".".join(parts[:private]))


def _format_steps(given: str, manager: CheckpointManager, steps: list[int]) -> str:
    """A manager's directory: its committed steps, each with its size (and,
    compressed, the bytes its files take) and metrics."""
    rows = []
    tiers = manager.tier_steps()
    for step in steps:
        ckpt = Checkpoint(manager.step_path(step))
        metrics = ", ".join(f"{name}={_metric(value)}" for name, value in sorted(manager.metrics(step).items()))
        stored = ckpt.stored_bytes if ckpt.compression is not None else None
        size = human(ckpt.total_bytes) + ("" if stored is None else f" ({human(stored)} stored)")
        if manager.local is not None:  # in which tiers it is
            metrics = " ".join(filter(None, ["[" + "+".join(t for t in tiers if step in tiers[t]) + "]", metrics]))
        rows.append((f"step {step}", f"{len(ckpt)} leaves", size, metrics))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.append(
        f"{len(steps)} steps in a CheckpointManager directory; "
        f"`eqx-ckpt ls {_step_path(given, manager, steps[-1])}` lists one"
    )
    return printable("\n".join(lines))


def _metric(value: Any) -> str:
    """A metric as people read it: a float to six significant digits, an int as it is."""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _info(args: argparse.Namespace) -> int:
    try:
        ckpt = Checkpoint(_path(args.path), token=args.token, base=_with_base(args))
    except CheckpointNotFoundError as missing:
        manager, steps = _manager_steps(args.path, missing, args.local)
        latest = _step_path(args.path, manager, steps[-1])
        print(printable(f"{_describe_steps(args.path, steps)}, not one checkpoint."))
        for tier, held in manager.tier_steps().items() if manager.local is not None else ():
            where = manager.local if tier == "local" else args.path
            print(printable(f"{tier} tier ({where}): {_count(len(held), 'step')} ({_shown(held)})"))
        print(printable(f"`eqx-ckpt info {latest}` describes the latest; `eqx-ckpt ls {args.path}` lists them all."))
        return 0
    print(f"path:            {printable(ckpt.path)}")
    if ckpt.revision is not None:
        print(f"revision:        {ckpt.revision}")
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
    for key, value in ckpt.info.items():  # a published folder's `info` (eqx_ckpt.json)
        print(f"info:            {printable(key)}={printable(json.dumps(value, sort_keys=True))}")
    print(f"leaves:          {len(ckpt)}")
    if ckpt._manifest.iterators:
        print(f"iterators:       {printable(_iterators_line(ckpt._manifest.iterators))}")
    print(f"bytes:           {ckpt.total_bytes} ({human(ckpt.total_bytes)})")
    if ckpt.compression is not None:
        print(f"compression:     {ckpt.compression}")
        stored = ckpt.stored_bytes
        if stored is not None:
            ratio = stored / max(ckpt.total_bytes, 1)
            print(f"stored:          {stored} ({human(stored)}, {ratio:.2f}x, checksums included)")
    digests = ckpt._manifest.digests  # (a published folder's, in eqx_ckpt.json)
    if digests:
        every = "" if len(digests) == len(ckpt) else f" ({len(digests)} of the {len(ckpt)} leaves)"
        strength = _verified.strength(ckpt._manifest)
        print(f"digests:         {strength}{every}")
    taken = ckpt.from_base()
    if taken:
        stored = ckpt.total_bytes - sum(ckpt.record(path).nbytes for path in taken)
        print(f"base:            {printable(str(ckpt.base))}")
        here = len(ckpt) - len(taken)
        leaves = "leaf" if here == 1 else "leaves"
        print(f"stored here:     {here} {leaves}, {human(stored)}; {len(taken)} read from the base")
        if ckpt.base_missing is not None:
            loads = "loads" if here == 1 else "load"
            print(f"base missing:    {printable(ckpt.base_missing)} Only the {here} {leaves} stored here {loads}.")
    if ckpt.format == "eqx_ckpt":
        shared = _shared_files(location(_path(args.path)))
        if shared is not None:
            count, nbytes = shared
            print(f"shared:          {count} files, {human(nbytes)}, also used by other checkpoints or steps")
    return 0


def _iterators_line(records: Sequence[IteratorRecord]) -> str:
    """`info`'s line of the iterator states: how many, of which leaves, saved by how many processes."""
    states, processes = sum(len(r.states) for r in records), sorted({len(r.states) for r in records})
    paths = [r.path for r in records]
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    by = str(processes[0]) if len(processes) == 1 else f"{processes[0]} to {processes[-1]}"
    process = "process" if processes == [1] else "processes"
    return f"{_count(states, 'state')} of {_count(len(paths), 'iterator')} ({shown}), saved by {by} {process}"


def _shared_files(loc: Location) -> tuple[int, int] | None:
    """The files (and bytes) of the checkpoint at `loc` that others also use;
    `None` where files are never shared (off a local disk, the OCDBT layout)."""
    if loc.local is None:
        return None
    source = _source.checkpoint(loc)
    if source is None or source.manifest.layout != "directories":
        return None
    return _share.shared_files(source.data.local or loc.local)


# Problems printed of one checkpoint or step, and damaged files named: one
# flipped bit in a file that six steps share once printed 294 lines.
# `eqx_ckpt.verify` returns every problem.
_SHOWN_PROBLEMS = 10
_SHOWN_FILES = 10
# Lines of `diff` printed before its totals.
_SHOWN_DIFFERENCES = 50


def _verify(args: argparse.Namespace) -> int:
    problems = verify(_path(args.path), token=args.token, base=_with_base(args))
    # The answer, even if the reader goes away (`main`): damage is 1; a step
    # written by a newer eqx_ckpt is no damage, but it was not checked either.
    args.code = 1 if problems else 2 if problems.newer else 0
    lines = _root_causes(args.path, problems)
    if problems.steps or problems.newer:
        lines += _format_verified_steps(args.path, problems)
    else:
        lines += _problem_lines(list(problems), "")
        lines += [f"not checked: {limit}" for limit in problems.unchecked]
        lines += [f"checked: {what}" for what in problems.checked]
        lines.append(f"{args.path}: {'sound' if not problems else f'{len(problems)} problem(s)'}")
    print(printable("\n".join(lines)))
    return args.code


def _push(args: argparse.Namespace) -> int:
    options = PushOptions(
        args.repo,
        private=args.private,
        revision=args.revision,
        commit_message=args.message,
        tag=args.tag,
        export=ExportOptions(
            max_shard_size=args.max_shard_size,
            info=_metadata_values(args.metadata),
            prefix=args.prefix,
            license=args.license,
            base_model=args.base_model or None,
            code=args.code,
            base=args.base,
            standalone=args.standalone,
            token=args.token,
        ),
    )
    published, report = publish(_chosen(args, args.path, args.repo), options)
    unchanged = "" if published.changed else " (unchanged: the repository held this export already; nothing committed)"
    print(f"hf://{args.repo}@{published.commit}{unchanged}")
    _report(report)
    return 0


def _report(report: str | None) -> None:
    """Say what an export or a push against a base stored and took from it,
    on stderr: stdout stays the files written, or the commit."""
    if report is not None:
        print(printable(f"eqx-ckpt: {report}"), file=sys.stderr)


def _chosen(args: argparse.Namespace, given: str, target: str) -> Checkpoint:
    """What `export` and `push` read (`given`, written to `target`): the
    checkpoint there, or the step of the manager's directory there that
    `--step` or `--best` chooses; without either, an error naming its steps
    and the best."""
    if args.step is None and not args.best:
        try:
            return Checkpoint(_path(given), token=args.token, base=_with_base(args))
        except CheckpointNotFoundError as missing:
            manager, steps = _manager_steps(given, missing)
            raise CheckpointValueError(_steps_hint(args, given, target, manager, steps)) from None
    manager = CheckpointManager(_path(given))
    steps = manager.all_steps()
    if not steps:
        raise CheckpointNotFoundError(
            f"{given} holds no step of a CheckpointManager: `--step` and `--best` choose one of its steps.",
            path=given,
        )
    step = manager.best_step() if args.best else args.step
    if step is None:
        raise CheckpointValueError(f"No step of {given} has the metric that ranks its steps: pass `--step N`.")
    if step not in steps:
        raise CheckpointValueError(f"{_describe_steps(given, steps)}, and no step {step}: pass one of them.")
    best = f" (the best: {_best_metric(given, manager, step)})" if args.best else ""
    _report(f"{'exporting' if args.command == 'export' else 'pushing'} step {step} of {given}{best}")
    return Checkpoint(manager.step_path(step), token=args.token, base=_with_base(args))


def _best_metric(given: str, manager: CheckpointManager, step: int) -> str:
    """`metric=value` of the best `step`, by the metric that ranks the manager's steps."""
    metric = manager.best_metric or recorded_best(location(_path(given)))[0]
    return f"{metric}={_metric(manager.metrics(step).get(metric or ''))}"


def _steps_hint(args: argparse.Namespace, given: str, target: str, manager: CheckpointManager, steps: list[int]) -> str:
    """What to export or push of a manager's directory: its latest step, its
    best (by the metric its retention record names, if any), or `--step`/`--best`."""
    latest = _step_path(given, manager, steps[-1])
    hint = f"`eqx-ckpt {args.command} {latest} {target}` (the latest)"
    try:
        best = manager.best_step()
    except CheckpointValueError:  # no metric ranks its steps
        best = None
    if best is not None:
        hint += f", `{_step_path(given, manager, best)}` (the best: {_best_metric(given, manager, best)})"
    options = "`--step N` or `--best`" if best is not None else "`--step N`"
    return (
        f"{_describe_steps(given, steps)}, not one checkpoint: {args.command} one of its steps, e.g. {hint}, or "
        f"pass {options}."
    )


def _metadata_values(items: list[str]) -> dict[str, Any] | None:
    """`--metadata KEY=VALUE` items as a dict: a value as JSON where it is JSON
    of finite numbers (`0.0576`, `true`), else as a string (`abc`, `NaN`)."""
    found: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise CheckpointValueError(f"`--metadata {item}` must be KEY=VALUE, e.g. `--metadata val_loss=0.0576`.")
        if key in found:
            raise CheckpointValueError(f"`--metadata` gives {key!r} twice.")
        try:
            value = json.loads(text)
            json.dumps(value, allow_nan=False)  # `NaN`, `1e999`: JSON that `info` cannot hold
        except ValueError:
            value = text
        found[key] = value
    return found or None


def _root_causes(path: str, problems: Problems) -> list[str]:
    """The damaged files first, each with the leaves and steps it damages (steps
    share unchanged chunk files, and the leaves of a pack its chunks)."""
    files = problems.damaged_files()
    if not files:
        return []
    caused = [problem for _, group in files for problem in group]
    steps = sorted({problem.step for problem in caused if problem.step is not None})
    leaves = len({problem.leaf for problem in caused})
    head = f"{_count(len(files), 'damaged file')}, used by {_count(leaves, 'leaf', 'leaves')}"
    lines = [head + (f" in {_count(len(steps), 'step')}" if steps else "") + ":"]
    for file, group in files[:_SHOWN_FILES]:
        used = sorted({problem.step for problem in group if problem.step is not None})
        shown = _count(len({problem.leaf for problem in group}), "leaf", "leaves")
        lines.append(f"  {_shown_path(path, file)}: {shown}{_in_steps(used)}; the first says:")
        lines.append(f"    {group[0]}")
    if len(files) > _SHOWN_FILES:
        lines.append(f"  and {_count(len(files) - _SHOWN_FILES, 'more damaged file')}")
    fix = "restore it from a good copy" if len(files) == 1 else "restore them from a good copy"
    shared = " (steps share unchanged chunk files: see docs/manager.md)" if len(steps) > 1 else ""
    lines.append(f"Every leaf that uses a damaged file is damaged{shared}: {fix}.")
    return lines


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _in_steps(steps: list[int]) -> str:
    if not steps:
        return ""
    if len(steps) <= 6:
        return f" in {'step' if len(steps) == 1 else 'steps'} {', '.join(map(str, steps))}"
    return f" in {len(steps)} steps ({steps[0]}, {steps[1]}, ..., {steps[-1]})"


def _problem_lines(problems: list[Problem], prefix: str) -> list[str]:
    """The problems of one checkpoint (or step): those of the damaged files
    named above in one line, then at most `_SHOWN_PROBLEMS` others."""
    lines = []
    named = sorted(str(problem.leaf) for problem in problems if problem.file is not None)
    if named:
        more = f" and {len(named) - 5} more" if len(named) > 5 else ""
        lines.append(
            f"{prefix}{_count(len(named), 'leaf', 'leaves')} in the damaged files above: {', '.join(named[:5])}{more}"
        )
    others = [str(problem) for problem in problems if problem.file is None]
    lines += others[:_SHOWN_PROBLEMS]
    if len(others) > _SHOWN_PROBLEMS:
        more = _count(len(others) - _SHOWN_PROBLEMS, "more problem")
        lines.append(f"{prefix}... and {more} (`eqx_ckpt.verify` returns them all)")
    return lines


def _shown_path(given: str, file: str) -> str:
    """A local `file` named as the user named the place it is in: below the
    path `given` (relative, if that was), else as it is."""
    if given.lstrip().startswith("{") or "://" in given:
        return file
    relative = os.path.relpath(file, os.path.abspath(given))
    return file if relative.startswith("..") else os.path.join(given, relative)


def _format_verified_steps(path: str, problems: Problems) -> list[str]:
    """A manager's directory verified: each step's problems (or `sound`), then
    the steps that are damaged, and those of a newer format."""
    lines = []
    for step in problems.steps:
        own = [problem for problem in problems if problem.step == step]
        lines += _problem_lines(own, f"step {step}: ")
        lines.append(f"step {step}: {f'{len(own)} problem(s)' if own else 'sound'}")
    lines += [f"not checked: {limit}" for limit in problems.unchecked]
    damaged = sorted({problem.step for problem in problems if problem.step is not None})
    verdict = f"{len(damaged)} damaged: {damaged}" if damaged else "sound"
    if problems.newer:
        verdict += f"; {len(problems.newer)} of a newer format, not checked: {list(problems.newer)}"
    lines.append(f"{path}: {_count(len(problems.steps), 'step')} in a CheckpointManager directory, {verdict}")
    return lines


def _diff(args: argparse.Namespace) -> int:
    try:
        differences = diff(_path(args.a), _path(args.b), token=args.token)
    except CheckpointNotFoundError as missing:
        given = args.a if missing.path == location(_path(args.a)).display else args.b
        manager, steps = _manager_steps(given, missing)
        pair = [_step_path(given, manager, step) for step in steps[-2:]]
        raise CheckpointValueError(
            f"{_describe_steps(given, steps)}, not one checkpoint: `eqx-ckpt diff` compares two checkpoints, "
            f"such as two of its steps: `eqx-ckpt diff {' '.join(pair) if len(pair) == 2 else pair[0] + ' B'}`."
        ) from None
    args.code = 1 if differences else 0
    lines = differences.lines(magnitudes=True)
    for line in lines[:_SHOWN_DIFFERENCES]:
        print(printable(line))
    if len(lines) > _SHOWN_DIFFERENCES:
        print(f"... and {len(lines) - _SHOWN_DIFFERENCES} more differences (`eqx_ckpt.diff` returns them all)")
    if differences:
        print(differences.summary())
    else:
        print(
            f"{printable(args.a)} and {printable(args.b)} are equal: the same leaves, dtypes, shapes, values "
            f"and structure."
        )
    return args.code


def _export(args: argparse.Namespace) -> int:
    parts = [rule.partition("=") for rule in args.rename]
    rules = [(pattern, replacement if sep else None) for pattern, sep, replacement in parts]
    metadata: dict[str, str] = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CheckpointValueError(f"`--metadata {item}` must be KEY=VALUE, e.g. `--metadata format=pt`.")
        if metadata.get(key, value) != value:
            raise CheckpointValueError(f"`--metadata` gives {key!r} twice ({metadata[key]!r} and {value!r}).")
        metadata[key] = value
    try:
        info = None if args.info is None else json.loads(args.info)
    except ValueError as e:
        raise CheckpointValueError(
            f'`--info` must be a JSON object, e.g. \'{{"description": "..."}}\' ({e}).'
        ) from None
    options = ExportOptions(
        max_shard_size=args.max_shard_size,
        rename=rules or None,
        metadata=metadata or None,
        info=info,
        prefix=args.prefix,
        card=not args.no_card,
        license=args.license,
        base_model=args.base_model or None,
        code=args.code,
        base=None if args.base is None else _path(args.base),
        standalone=args.standalone,
        token=args.token,
    )
    written = export(_path(args.out), _chosen(args, args.ckpt, args.out), options)
    for name in written.names:
        print(name)
    _report(written.report)
    return 0


def _merge(args: argparse.Namespace) -> int:
    where = args.where or None
    merge(
        _path(args.out),
        [_path(given) for given in args.inputs],
        method=args.method,
        weights=args.weights,
        base=None if args.base is None else _path(args.base),
        density=args.density,
        t=args.t,
        key=args.seed,
        where=where,
    )
    print(f"{printable(args.out)}: a {args.method} merge of {len(args.inputs)} inputs")
    return 0


def _merge_parser(commands: Any) -> None:
    merge = commands.add_parser(
        "merge", help="merge models leaf by leaf into a new checkpoint; exit 0 written, 2 error", epilog=STORAGE_HELP
    )
    merge.add_argument("out", help="the checkpoint to write")
    merge.add_argument("inputs", nargs="+", metavar="input", help="the models: checkpoints, published folders, hf://")
    merge.add_argument("--method", required=True, choices=METHODS, help="how leaves are merged")
    merge.add_argument("--weights", type=float, nargs="+", default=None, help="one weight per input (default: 1)")
    merge.add_argument("--base", default=None, help="the model differences are taken from (all but linear, slerp)")
    merge.add_argument("--density", type=float, default=None, help="the fraction of each difference kept (ties, dare)")
    merge.add_argument("--t", type=float, default=None, help="slerp: 0 the first input, 1 the second")
    merge.add_argument("--seed", type=int, default=None, help="the key of dare's random drops (default 0)")
    merge.add_argument(
        "--where", action="append", default=[], metavar="PATH", help="merge only this sub-tree (repeatable)"
    )
    merge.set_defaults(run=_merge)


# The one way the CLI reaches an S3-compatible server (docs/storage.md says the same).
STORAGE_HELP = (
    "An S3-compatible server (MinIO, Ceph, a local test server): set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) "
    "to its URL, e.g. http://127.0.0.1:9000, with the usual AWS credentials variables, and pass s3://bucket/path. "
    "Other kvstore options (credentials, retries such as s3_request_retries): pass the path as a TensorStore "
    'kvstore spec in JSON, e.g. \'{"driver": "s3", "bucket": "my-bucket", "path": "run/ckpt/", "s3_request_retries": '
    '{"max_retries": 20}}\'. Storage that cannot be reached fails within seconds (exit 2).'
)


def _export_parser(commands: Any) -> None:
    export = _reader(
        commands,
        "export",
        _export,
        "write a checkpoint as (Hugging Face sharded) safetensors",
        "ckpt",
        "checkpoint directory (or a CheckpointManager's, with --step or --best), kvstore URL or spec",
    )
    export.add_argument("out", help="output directory (or a path ending in .safetensors for one file)")
    export.add_argument("--format", choices=["safetensors"], default="safetensors", help="output format")
    export.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="PATTERN[=REPLACEMENT]",
        help="regex rule from dotted path to tensor name (repeatable, first match wins); a PATTERN alone leaves "
        "the matching leaves out",
    )
    export.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a string for each file's __metadata__, e.g. format=pt (repeatable)",
    )
    export.add_argument(
        "--info",
        default=None,
        metavar="JSON",
        help="your metadata, kept in eqx_ckpt.json and shown on the model card: a JSON object, e.g. "
        '\'{"description": "...", "metrics": {"loss": 0.1}}\'',
    )
    export.add_argument("--no-card", action="store_true", help="write no README.md (leave one there as it is)")
    _export_options(export, "export")
    _step_options(export, "export")


def _export_options(command: Any, verb: str) -> None:
    """The options of `export` and `push` that size the shards, choose a sub-tree and fill the model card."""
    command.add_argument("--max-shard-size", default="5GB", help="bytes per shard, e.g. 5GB, 500MB (default 5GB)")
    command.add_argument(
        "--prefix", default=None, help=f"{verb} only the sub-tree at this dotted path (e.g. model), which it loads as"
    )
    command.add_argument("--license", default=None, help="the card's license, a Hub license id (e.g. apache-2.0)")
    command.add_argument(
        "--base-model",
        action="append",
        default=[],
        metavar="OWNER/NAME",
        help="the card's base_model: a Hub repository it was made from (repeatable)",
    )
    command.add_argument(
        "--code", default=None, help="where the model's classes come from: a pip requirement or a URL, for the card"
    )
    family = command.add_mutually_exclusive_group()
    family.add_argument(
        "--base",
        default=None,
        metavar="PATH",
        help=f"{verb} a fine-tune as what changed: only the leaves that differ from this base (hf://owner/name, or "
        "for export a checkpoint or published folder); loads read the rest from it",
    )
    family.add_argument(
        "--standalone",
        action="store_true",
        help=f"{verb} every leaf of a fine-tune, its base's too, so that it loads without its base",
    )


def _push_parser(commands: Any) -> None:
    push = commands.add_parser(
        "push",
        help="publish a checkpoint to the Hugging Face Hub in one commit; prints hf://owner/name@<commit>",
        epilog='Needs the optional extra: pip install "eqx_ckpt[hub]". The token is HF_TOKEN, or the one '
        "`hf auth login` saved, unless --token is given. Load it back from hf://owner/name@<commit>.",
    )
    push.add_argument(
        "path", help="checkpoint directory (or a CheckpointManager's, with --step or --best), kvstore URL or spec"
    )
    push.add_argument("repo", help="the repository, owner/name (made where there is none)")
    push.add_argument("--revision", default=None, help="the branch to commit to (default: the default branch)")
    push.add_argument("--private", action="store_true", help="make a new repository private")
    push.add_argument("--token", default=None, help="a Hub token with write access (default: HF_TOKEN)")
    push.add_argument("--with-base", default=None, metavar="PATH", help=_WITH_BASE_HELP)
    push.add_argument("--message", default="Upload model with eqx_ckpt", help="the commit message")
    push.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="your metadata, kept in eqx_ckpt.json and shown on the model card (repeatable); a VALUE that is "
        "JSON is read as JSON (val_loss=0.0576 a number), any other as a string",
    )
    _export_options(push, "publish")
    push.add_argument(
        "--tag", default=None, help="a tag to put on the commit, e.g. v1.0 (load it as hf://owner/name@v1.0)"
    )
    _step_options(push, "push")
    push.set_defaults(run=_push)


def _step_options(command: Any, verb: str) -> None:
    """`--step` and `--best`, of `export` and `push`: which step of a manager's directory to read."""
    chosen = command.add_mutually_exclusive_group()
    chosen.add_argument("--step", type=int, default=None, help=f"of a CheckpointManager's directory, {verb} this step")
    chosen.add_argument(
        "--best", action="store_true", help=f"of a CheckpointManager's directory, {verb} the step with the best metric"
    )


_PATH_HELP = "checkpoint directory, kvstore URL, or kvstore spec as JSON"
_TOKEN_HELP = "a Hugging Face Hub token, for an hf:// path of a private or gated repository (default: HF_TOKEN)"
_WITH_BASE_HELP = (
    "for a fine-tune stored against a base: read its base from PATH instead of where its record says (needed where "
    "that is not an hf:// base or a folder beside the fine-tune); its leaves are checked against the fine-tune's "
    "digests"
)


_LOCAL_HELP = "of a CheckpointManager directory: its local tier (`local=`), whose steps are shown too, with their tiers"


def _reader(commands: Any, name: str, run: Any, help: str, path: str = "path", path_help: str = _PATH_HELP) -> Any:
    """A command reading the checkpoint at its `path` (a fine-tune's base too: `--with-base`)."""
    command = commands.add_parser(name, help=help, epilog=STORAGE_HELP)
    command.add_argument(path, help=path_help)
    command.add_argument("--token", default=None, help=_TOKEN_HELP)
    command.add_argument("--with-base", default=None, metavar="PATH", help=_WITH_BASE_HELP)
    command.set_defaults(run=run)
    return command


def _with_base(args: argparse.Namespace) -> Any:
    """The base a command was given for the fine-tune it reads (`--with-base`), or `None`."""
    return None if args.with_base is None else _path(args.with_base)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="eqx-ckpt",
        description="Inspect, verify and compare eqx_ckpt checkpoints. Exit codes: 0 ok "
        "(verify: sound, diff: equal), 1 verify found damage / diff found differences, 2 error (verify: also a "
        "checkpoint or step of a newer format than this eqx_ckpt reads, which is not damage).",
    )
    top.add_argument("--version", action="version", version=f"eqx-ckpt {__version__}")
    commands = top.add_subparsers(dest="command", required=True)
    ls = _reader(commands, "ls", _ls, "sorted tree of keys with dtype[shape] and size")
    ls.add_argument("--local", default=None, metavar="DIR", help=_LOCAL_HELP)
    ls.add_argument("--depth", type=int, default=None, help="show only this many levels")
    ls.add_argument("--values", action="store_true", help=f"print leaves of at most {SMALL_VALUES} elements")
    ls.add_argument(
        "--types", action="store_true", help="the classes and functions a load without `like` needs trusted"
    )
    info = _reader(
        commands, "info", _info, "format and library version, creation time, leaf count, iterator states, bytes"
    )
    info.add_argument("--local", default=None, metavar="DIR", help=_LOCAL_HELP)
    _reader(
        commands,
        "verify",
        _verify,
        "read and check every byte (of other formats: what they can be checked for); exit 0 sound, "
        "1 damaged, 2 error or a newer format (not damage: upgrade eqx_ckpt)",
        path_help="checkpoint, .safetensors file, Hugging Face or orbax directory, kvstore URL",
    )
    diff = commands.add_parser(
        "diff", help="compare two checkpoints; exit 0 equal, 1 different, 2 error", epilog=STORAGE_HELP
    )
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--token", default=None, help=_TOKEN_HELP)
    diff.set_defaults(run=_diff)
    _export_parser(commands)
    _push_parser(commands)
    _merge_parser(commands)
    demo = commands.add_parser("demo", help="train a small model, save, list and reload it")
    demo.add_argument("--dir", default=None, help="where to save (default: a new temporary directory)")
    demo.add_argument("--steps", type=int, default=50, help="training steps")
    demo.set_defaults(run=lambda args: run(args.dir, steps=args.steps))
    return top


def _end_interrupted() -> None:
    """In the `eqx-ckpt` program itself, end at once with 130 once eqx_ckpt's
    own exit work is done (saves in flight waited for, its threads stopped):
    the interpreter's own exit crashed (SIGSEGV) when the interrupt left a JAX
    compile running, in jaxlib's client teardown (`eqx-ckpt demo`, a Ctrl-C
    as it compiles its training step). `main` called from Python returns 130:
    its caller's process goes on."""
    if not _PROGRAM:
        return  # (`main` called from Python: its caller goes on)
    _threads.run_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _interrupt_soon() -> None:
    """The main thread interrupted again, from another thread, once the callback
    that dropped its interrupt has returned (from the main thread itself, the
    handler would run at once, inside `sys.unraisablehook`, and be dropped there)."""
    time.sleep(0.05)
    _thread.interrupt_main()


@contextlib.contextmanager
def _interrupts_delivered() -> Iterator[None]:
    """A Ctrl-C whose `KeyboardInterrupt` is raised where Python drops
    exceptions (a finaliser, a garbage collector's callback: JAX keeps one)
    is raised again, not lost: it was printed as "Exception ignored" and the
    command went on (issue 88: `eqx-ckpt demo` trained on). Python hands such
    an exception to `sys.unraisablehook`; from there the main thread is
    interrupted again once that callback has returned (if that lands in
    another such callback, once more)."""
    hook = sys.unraisablehook

    def redeliver(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _threads.thread("eqx_ckpt-interrupt", _interrupt_soon).start()
        else:
            hook(unraisable)

    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = hook


def main(argv: Sequence[str] | None = None) -> int:
    """Run `eqx-ckpt` with `argv`; returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("eqx-ckpt: interrupted", file=sys.stderr)
        return 130
    try:
        with command_line(), _interrupts_delivered():  # (messages name this command's flags, `--base`)
            code: Any = args.run(args)
    except CheckpointError as e:
        print(f"eqx-ckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: the user knows where; a traceback says nothing more.
        print(f"eqx-ckpt {args.command}: interrupted", file=sys.stderr)
        _end_interrupted()
        return 130
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
