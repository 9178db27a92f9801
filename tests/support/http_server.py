"""Loads over plain `http://`: a local directory served on 127.0.0.1, a URL whose
port nothing listens on, and a way to run loads that might hang."""

from __future__ import annotations

import ast
import contextlib
import functools
import http.server
import json
import os
import pathlib
import re
import socket
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import prefork


class Files(http.server.SimpleHTTPRequestHandler):
    """Python's own file server, without a log line per request."""

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(directory: Any) -> Iterator[str]:
    """Serve `directory` as Python's own file server does (no range requests:
    a byte range is answered with the whole file), yielding its base URL. On
    leaving, the port is closed: a later connection to it is refused."""
    with serve(functools.partial(Files, directory=str(directory))) as url:
        yield url


@contextlib.contextmanager
def serve(handler: Any) -> Iterator[str]:
    """Serve requests with `handler` (a request handler class) on 127.0.0.1,
    yielding the base URL; on leaving, the port is closed."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def refused_url(path: str) -> str:
    """A URL on 127.0.0.1 whose port was free a moment ago: a connection to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/{path}"


_CHILD = """
import json, sys, time
sys.path.insert(0, {tests!r})
{code}
name = list(CALLS)[int(sys.argv[1])]
start = time.monotonic()
try:
    CALLS[name]()
    raised = None
except Exception as e:
    raised = e
kind = type(raised)
print("RESULT " + json.dumps({{"call": name, "seconds": time.monotonic() - start, "message": str(raised),
                              "type": f"{{kind.__module__}}.{{kind.__qualname__}}"}}), flush=True)
"""


def _call_names(code: str) -> list[str]:
    """The keys of the dict literal `CALLS = {...}` in `code`, in order."""
    for node in ast.walk(ast.parse(code)):
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["CALLS"]
            and isinstance(node.value, ast.Dict)
        ):
            return [ast.literal_eval(key) for key in node.value.keys if key is not None]
    raise ValueError("`code` must assign a dict literal to `CALLS`, its keys strings")


def raised(code: str, *, timeout: float = 120) -> dict[str, dict[str, Any]]:
    """Run `code`, which defines `CALLS` (a dict literal, name -> function of
    no arguments), then one of the calls, in a new process for each call (all
    at once, each forked from a template that imported JAX: `prefork.spawn`;
    the calls wait out retries side by side); for each call, what it raised:
    its `type` (`eqx_ckpt.CheckpointConnectionError`), `message` and
    `seconds`. A call that hangs fails the test at `timeout` instead of
    blocking the whole run."""
    code = textwrap.dedent(code)
    names = _call_names(code)
    child = _CHILD.format(tests=str(pathlib.Path(__file__).parent), code=code)
    with tempfile.TemporaryDirectory() as folder:
        outputs = [pathlib.Path(folder, f"{i}.out") for i in range(len(names))]
        env = dict(os.environ)
        processes = [prefork.spawn(["-c", child, str(i)], env=env, output=out) for i, out in enumerate(outputs)]
        deadline = time.monotonic() + timeout
        try:
            codes = [process.wait(timeout=max(deadline - time.monotonic(), 0.0)) for process in processes]
        finally:
            for process in processes:
                process.kill()
        said = [out.read_text(errors="replace") for out in outputs]
    found: dict[str, dict[str, Any]] = {}
    for name, returncode, text in zip(names, codes, said):
        assert returncode == 0, (name, text[-3000:])
        lines = [json.loads(line[len("RESULT ") :]) for line in text.splitlines() if line.startswith("RESULT ")]
        assert [line.pop("call") for line in lines] == [name], (name, text[-3000:])
        found[name] = lines[0]
    return found


_COUNTING = threading.Lock()


class RangeServer(http.server.BaseHTTPRequestHandler):
    """Serves files from `root` with HTTP range requests, counting body bytes sent."""

    root: ClassVar[dict[str, bytes]] = {}
    sent = 0

    def do_GET(self):
        data = self.root.get(self.path.lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        lo, hi = (int(match.group(1)), int(match.group(2) or len(data) - 1)) if match else (0, len(data) - 1)
        body = data[lo : hi + 1]
        self.send_response(206 if match else 200)
        if match:
            self.send_header("Content-Range", f"bytes {lo}-{lo + len(body) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # Counted before sending: once the client has the bytes, the count has them.
        with _COUNTING:
            type(self).sent += len(body)
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving_ranges(files: dict[str, bytes]) -> Iterator[str]:
    """Serve `files` (name -> bytes) by `RangeServer`, its count of bytes sent reset, yielding its base URL."""
    RangeServer.root, RangeServer.sent = files, 0
    with serve(RangeServer) as url:
        yield url
