"""An S3-compatible server on 127.0.0.1 for the tests: moto's, with a gate in front.

moto (`moto[s3]`, in the `test` extra) implements the S3 REST API; TensorStore's
`s3` kvstore talks to it over HTTP exactly as it would to AWS. The gate lets a
test hold the server's writes of array chunks (so a save is provably still in
flight) or refuse them (so a save fails in the background, for real, over HTTP).
One server may serve a whole test session (tests/conftest.py: one per pytest
worker): `S3Server.reset` empties it between tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

BUCKET = "eqx-ckpt-test"


class Gate:
    """WSGI middleware: holds or refuses `PUT`s of zarr chunk objects (keys with a
    `c` path segment, as zarr v3's default chunk key encoding writes), refuses
    `GET`s and `PUT`s of chosen paths, and records the paths asked for."""

    def __init__(self, app: Any):
        self.app = app
        self.open = threading.Event()
        self.open.set()
        self.refuse = False
        # GETs of a path containing this are refused with 403 AccessDenied ("": none).
        self.forbidden = ""
        self.held = threading.Event()
        # PUTs of a path this regular expression finds something in are refused too ("": none).
        self.forbidden_puts = ""
        # (path, Range header) of every GET, for tests of what a read downloads.
        self.gets: list[tuple[str, str | None]] = []
        # The path of every PUT, for tests of what a save writes.
        self.puts: list[str] = []
        # Requests being answered now (`S3Server.reset` waits for none).
        self.busy = 0
        self.idle = threading.Condition()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self.idle:
            self.busy += 1
        try:
            return self._answer(environ, start_response)
        finally:
            with self.idle:
                self.busy -= 1
                self.idle.notify_all()

    def _answer(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] == "GET":
            self.gets.append((path, environ.get("HTTP_RANGE")))
            if self.forbidden and self.forbidden in path:
                return self._refused(start_response)
        if environ["REQUEST_METHOD"] == "PUT":
            self.puts.append(path)
            if self.forbidden_puts and re.search(self.forbidden_puts, path):
                return self._refused(start_response)
        if environ["REQUEST_METHOD"] == "PUT" and ("/c/" in path or path.endswith("/c")):
            self.held.set()
            self.open.wait(timeout=30)
            if self.refuse:
                return self._refused(start_response)
        return self.app(environ, start_response)

    @staticmethod
    def _refused(start_response: Any) -> list[bytes]:
        body = b"<Error><Code>AccessDenied</Code><Message>refused by the test</Message></Error>"
        start_response("403 Forbidden", [("Content-Type", "application/xml")])
        return [body]

    def reset(self) -> None:
        self.refuse = False
        self.forbidden = ""
        self.forbidden_puts = ""
        self.held.clear()
        self.open.set()


class S3Server:
    def __init__(self) -> None:
        moto_server = pytest.importorskip(
            "moto.moto_server.werkzeug_app",
            reason="moto is not installed; `pip install -e .[test]` installs it (the S3 tests need a local S3 server)",
        )
        from werkzeug.serving import make_server

        class QuietHandler(moto_server.MotoRequestHandler):
            def log(self, *args: Any, **kwargs: Any) -> None:
                pass  # one line per request would drown a failing test's output

        self.gate = Gate(moto_server.DomainDispatcherApplication(moto_server.create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.gate, threaded=True, request_handler=QuietHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._bucket()

    def _bucket(self) -> None:
        # moto accepts unsigned requests, so the bucket is made without an S3 client.
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")).close()

    def reset(self) -> None:
        """As new: the gate open and refusing nothing, once no request is
        being answered (a save's held writes released); every bucket and
        object gone (moto's own reset) but an empty `BUCKET`; moto's count of
        requests (`INITIAL_NO_AUTH_ACTION_COUNT` counts from it) and the
        gate's records of requests emptied."""
        from moto.core.authorization import ActionAuthenticatorMixin

        self.gate.reset()
        with self.gate.idle:
            self.gate.idle.wait_for(lambda: self.gate.busy == 0, timeout=30)
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).close()
        self._bucket()
        ActionAuthenticatorMixin.request_count = 0
        self.gate.gets.clear()
        self.gate.puts.clear()

    def spec(self, path: str) -> dict[str, Any]:
        """The kvstore spec of `s3://eqx-ckpt-test/<path>` on this server."""
        return {
            "driver": "s3",
            "bucket": BUCKET,
            "path": path,
            "endpoint": self.endpoint,
            "aws_region": "us-east-1",
            # A refused write fails at once instead of being retried for minutes.
            "s3_request_retries": {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"},
        }

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()


@contextlib.contextmanager
def running() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials: TensorStore signs every request (moto does not check the
    signature), and without them it would look for an EC2 metadata service."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # Empty AWS config files: the SDK stops logging that it found none.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
