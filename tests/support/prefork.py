"""`run(["-c", code])`: `subprocess.run([sys.executable, "-c", code])` in about
a second less, for tests that run many short snippets each in a new process
(tests/sources/test_hub.py's `Client`, tests/tools/test_cli.py). `spawn([script, *args])`:
`subprocess.Popen([sys.executable, script, *args])` likewise, for tests that
run several processes at once, signal them and wait for them
(tests/hosts/test_multiprocess.py): a `Process` with the pid of a real process, which
the test signals itself (`os.kill`), and its exit code, as `Popen` gives it.

A *template* process imports the libraries every snippet needs and none
reads a variable of the Hub's (numpy, JAX, Equinox, TensorStore, the HTTP
stack, eqx_ckpt: most of a 2.8 s start), runs nothing else, and forks a child
for each call. The child is a new process as `python -c CODE` or `python -m
MODULE ARGS` would be: its own environment, working directory, `__main__`,
`sys.argv` and output; nothing of an earlier call (each child is forked from
the template, never from another child); huggingface_hub imported in the
child (it reads `HF_*` variables at import); eqx_ckpt's heartbeat started
anew in the child, as in any process forked after the import; and it
exits as any interpreter does (threads joined, `atexit` functions run), but
for the teardown of its modules (`_exit`). A child of `spawn(...,
finalize=True)` (or `run`) exits through the interpreter's own finalization, teardown
included (`_Finalize`), as a test of how a process exits wants it.

A template is started with the environment of its children less their
`HF_*` variables and `PYTEST_CURRENT_TEST` (set in each child): a call whose
other variables differ gets another template (at most `TEMPLATES` run at once,
the one used longest ago ended first). `close()` ends them; each also ends
when the process that started it does (its input closes), killing a child
still running."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from typing import IO, Any

# What the template imports (those installed): eqx_ckpt's dependencies and
# huggingface_hub's. None reads an `HF_*` variable or starts a Python thread.
PRELOAD = ["numpy", "jax", "jax.numpy", "equinox", "tensorstore", "crc32c", "xxhash", "blake3", "orjson"]
PRELOAD += ["yaml", "fsspec", "tqdm", "filelock", "httpx2", "httpcore2", "anyio", "trio", "truststore"]
# And eqx_ckpt itself (a third of a second a child): it reads no variable at
# import, and a forked child starts its heartbeat anew (`_multihost._Heartbeat`).
# A child whose path finds another eqx_ckpt first imports that one (`_shadowed`).
PRELOAD += ["eqx_ckpt"]


# --- in the test's process ---


class _Template:
    def __init__(self, env: dict[str, str]):
        self.log = tempfile.TemporaryFile()
        here = os.path.dirname(os.path.abspath(__file__))
        # (`-c`, so that the children's `sys.path[0]` is `''` as under `python -c`)
        code = f"import sys; sys.path.insert(0, {here!r}); import prefork; del sys.path[0]; prefork.serve()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log
        )
        self.lock = threading.Lock()

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        with self.lock:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.log.seek(0)
            said = self.log.read().decode(errors="replace")[-6000:]
            raise RuntimeError(f"the template process ended (exit code {self.process.returncode}):\n{said}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.log.close()


# The templates running, by their environment, the one used last at the end.
_TEMPLATES: dict[tuple[tuple[str, str], ...], _Template] = {}
# How many may run at once (the tests of one worker use two or three environments).
TEMPLATES = 3
# Variables set in each child, never read by what the template imports.
_SET_IN_CHILD = ("HF_", "PYTEST_CURRENT_TEST")


def _template(env: dict[str, str]) -> _Template:
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_SET_IN_CHILD)))
    template = _TEMPLATES.pop(key, None)
    if template is not None and template.process.poll() is not None:
        template.close()
        template = None
    if template is None:
        while len(_TEMPLATES) >= TEMPLATES:
            _TEMPLATES.pop(next(iter(_TEMPLATES))).close()
        template = _Template(dict(key))
    _TEMPLATES[key] = template
    return template


def start(env: dict[str, str]) -> None:
    """Start the template for `env` now, so that its imports overlap with what the test does first."""
    if hasattr(os, "fork"):
        _template(env)


def run(
    args: list[str],
    *,
    env: dict[str, str],
    cwd: str | os.PathLike[str] | None = None,
    timeout: float,
    finalize: bool = False,
) -> Any:
    """As `subprocess.run([sys.executable, *args], env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout)`, where `args` is `["-c",
    code, *arguments]` or `["-m", module, *arguments]`: a `subprocess.CompletedProcess`,
    or `subprocess.TimeoutExpired` (the child killed). `finalize`: as `spawn`'s."""
    if args[0] not in ("-c", "-m") or len(args) < 2:
        raise ValueError(f"`args` must be ['-c', code, *arguments] or ['-m', module, *arguments], not {args!r}")
    command = [sys.executable, *args]
    if not hasattr(os, "fork"):  # (Windows: no template)
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    request = {"args": args, "env": env, "cwd": os.fspath(cwd or os.getcwd()), "timeout": timeout}
    if finalize:
        request["finalize"] = True
    done = _template(env).run(request)
    if done["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, done["stdout"], done["stderr"])
    return subprocess.CompletedProcess(command, done["returncode"], done["stdout"], done["stderr"])


class Process:
    """A child that `spawn` started, running beside the test: `pid` is a real
    process's (signal it with `os.kill`), `returncode` None until it ends, then
    its exit code (negative: the signal that ended it), as `subprocess.Popen`'s."""

    def __init__(self, template: _Template | None, pid: int, popen: subprocess.Popen | None = None):
        self.template, self.pid, self.popen = template, pid, popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.popen is not None:
                self.returncode = self.popen.poll()
            else:
                assert self.template is not None
                self.returncode = self.template.run({"poll": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["prefork", str(self.pid)], timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(
    args: list[str],
    *,
    env: dict[str, str],
    output: str | os.PathLike[str],
    cwd: str | None = None,
    finalize: bool = False,
) -> Process:
    """As `subprocess.Popen([sys.executable, *args], env=env, cwd=cwd,
    stdout=file, stderr=subprocess.STDOUT)`, `file` opened for writing at
    `output`, where `args` is `["-c", code]`, `["-m", module, *arguments]` or
    `[script, *arguments]`: a `Process`, started at once. `finalize`: the
    child's exit is the interpreter's whole finalization, as a new
    interpreter's (see `_Finalize`), not `_exit`'s shortcut."""
    if not hasattr(os, "fork"):  # (Windows: no template)
        with open(output, "w") as out:
            command = [sys.executable, *args]
            popen = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        return Process(None, popen.pid, popen)
    request = {"spawn": args, "env": env, "cwd": os.fspath(cwd or os.getcwd()), "output": os.fspath(output)}
    if finalize:
        request["finalize"] = True
    template = _template(env)
    return Process(template, template.run(request)["pid"])


def run_all(
    launches: list[tuple[list[str], os.PathLike[str]]],
    *,
    env: dict[str, str],
    timeout: float = 240,
    watch: Any = None,
) -> tuple[list[int], list[str]]:
    """`spawn` each `(args, output)` at once, and wait for every one (each
    left running after `timeout` seconds, or after an error, is killed);
    `watch(processes)` runs first, while they run. Their exit statuses, and
    their outputs' texts."""
    launched = [(spawn(args, env=env, output=output), output) for args, output in launches]
    try:
        if watch is not None:
            watch([process for process, _ in launched])
        codes = [process.wait(timeout=timeout) for process, _ in launched]
    finally:
        for process, _ in launched:
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes, [pathlib.Path(output).read_text() for _, output in launched]


def close() -> None:
    """End the templates: each one's input closed, it leaves its loop and exits."""
    while _TEMPLATES:
        _TEMPLATES.popitem()[1].close()


# --- in the template ---


def serve() -> None:
    """Import `PRELOAD`, then answer each request line on stdin with a child's result on stdout."""
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    os.dup2(2, 1)  # what an import prints is not a reply
    for name in PRELOAD:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)
    # What the imports made is never garbage: frozen, no child's collection
    # walks it (nor copies its pages, touching each object as it goes).
    gc.freeze()
    starter, template = os.getppid(), os.getpid()
    spawned: dict[int, int | None] = {}  # the children of `spawn`, and the exit code of each that ended
    try:
        while line := requests.readline():
            reply = _answer(json.loads(line), requests, replies, starter, spawned)
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
    finally:
        # (Not in a child leaving through here, `_Finalize`: these are its siblings.)
        for pid, code in spawned.items() if os.getpid() == template else ():  # (killed with whatever each started)
            if code is None:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)


class _Finalize(SystemExit):
    """Raised in a child of `spawn(..., finalize=True)` once its program has
    ended, with its exit code: it leaves the template's frames (which do
    nothing more in a child) and the template's `-c` program, so that the
    interpreter exits as a new one would: `threading`'s hooks and the threads
    joined, the `atexit` functions, then the teardown of the modules and the
    objects they hold (a C++ library's destructors among them), and last the
    exit code (a KeyboardInterrupt that ended the program: 1, as a new
    interpreter's when the interrupt lands in a handler).

    The objects the template's imports made (the same in every child: the
    modules and what they hold at import) were frozen (`gc.freeze`) before any fork, as a
    pre-forking server does (`serve`): the collections, the last ones of the
    exit among them, skip them, and collect everything the child made.
    Otherwise the exit's collections walk the template's whole heap, copying
    its pages as they go: a second more than a new interpreter's."""


def _answer(
    request: dict[str, Any], requests: IO[bytes], replies: IO[bytes], starter: int, spawned: dict[int, int | None]
) -> dict[str, Any]:
    """Run `request` (a `run`, `spawn` or `poll`): the reply."""
    if "poll" in request:
        pid = request["poll"]
        if spawned[pid] is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                spawned[pid] = os.waitstatus_to_exitcode(status)
        return {"returncode": spawned[pid]}
    if "spawn" in request:
        with open(request["output"], "wb") as out:
            pid = _fork(request, requests, replies, out, out, args=request["spawn"])
        spawned[pid] = None
        return {"pid": pid}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = _fork(request, requests, replies, out, err, args=request["args"])
        code, timed_out = _wait(pid, request["timeout"], starter)
        return {"returncode": code, "timed_out": timed_out, "stdout": _text(out), "stderr": _text(err)}


def _fork(
    request: dict[str, Any], requests: IO[bytes], replies: IO[bytes], out: IO[bytes], err: IO[bytes], args: list[str]
) -> int:
    """Fork the child that runs `args` (its output to `out` and `err`): its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # (restored in the child too)
        # Python 3.12+ warns of a fork in a process with threads: here
        # those of numpy's BLAS, which handles a fork.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        requests.close()
        replies.close()
        if request.get("finalize"):
            raise _Finalize(_child({**request, "args": args}, out, err))
        _exit(_child({**request, "args": args}, out, err))
    with contextlib.suppress(OSError):  # (as the child does: whichever runs first)
        os.setpgid(pid, pid)
    return pid


def _text(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _wait(pid: int, timeout: float, starter: int) -> tuple[int, bool]:
    """The child's exit code (negative: the signal that ended it), and
    whether it was killed for running past `timeout` seconds (or for the
    test's process having ended)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline or os.getppid() != starter:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(0.005)


def _child(request: dict[str, Any], out: IO[bytes], err: IO[bytes]) -> int:
    """Become `python -c`/`python -m` with the request's environment, folder and
    output, and run it: its exit code, as the interpreter gives it."""
    os.setpgid(0, 0)  # killed on time out with whatever it started
    for file, fd in ((out, 1), (err, 2)):
        os.dup2(file.fileno(), fd)
    out.close()
    err.close()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    # (`[script]` alone: a script run without arguments, `target` unused)
    flag, target, *arguments = request["args"] if len(request["args"]) > 1 else [*request["args"], ""]
    # The path's first entry as the interpreter sets it: `-c`'s `''` (the
    # current folder) is the template's already; `-m`, the current folder; a
    # script, its own folder. Then the eqx_ckpt that path finds.
    if flag == "-m":
        sys.path[0] = os.getcwd()
    elif flag != "-c":
        sys.path[0] = os.path.dirname(os.path.abspath(flag))
    _shadowed("eqx_ckpt")
    try:
        if flag == "-c":
            sys.argv = ["-c", *arguments]
            # (`dont_inherit`: compiled without this module's `from __future__` imports)
            exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
        elif flag == "-m":
            sys.argv = ["-m", *arguments]
            runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # (what `python -m` calls)
        else:  # a script
            sys.argv = request["args"]
            runpy.run_path(flag, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        # Printed as the interpreter prints it, without this function's frame.
        e = e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None)
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    return 0


def _shadowed(package: str) -> None:
    """Forget the template's `package` (and its modules) where the child's
    path finds another one first: an old release, a test's stand-in."""
    module = sys.modules.get(package)
    if module is None:
        return
    del sys.modules[package]  # (else `find_spec` answers with the module imported)
    try:
        found = importlib.util.find_spec(package)
    finally:
        sys.modules[package] = module
    if found is None or found.origin != module.__file__:
        for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
            del sys.modules[name]


def _exit(code: int) -> None:
    """End the child as an interpreter ends, up to its `atexit` functions (the
    hooks of `threading` and eqx_ckpt, non-daemon threads joined, then the
    `atexit` functions, the output flushed), but without tearing its modules
    down: half a second after JAX, for nothing a test looks at."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # (what the interpreter's exit calls first)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
