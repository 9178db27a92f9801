"""A Google Cloud Storage-compatible server on 127.0.0.1 for the tests.

`gcp-storage-emulator` (in the `test` extra) implements GCS's JSON API in
Python. TensorStore's `gcs` kvstore driver talks to it over HTTP when
`TENSORSTORE_GCS_HTTP_URL` names it and `GOOGLE_AUTH_TOKEN_FOR_TESTING` gives a
bearer token (the emulator checks none), exactly as it would to Google.

Two gaps are filled here. The emulator ignores the `startOffset`/`endOffset` of
an object listing, and TensorStore lists with them to delete a key range, so a
range delete would remove every object under the prefix: `_with_offsets` applies
them. And a download carries no `x-goog-generation` header and ignores
`ifGenerationNotMatch`, so TensorStore cannot revalidate what it cached (a read
through a cache pool, as of packed leaves, fails "Malformed StorageGeneration"):
`_with_generations` sends the header and answers 304 Not Modified as GCS does.
Everything else is the emulator's own behaviour.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import pytest

BUCKET = "eqx-ckpt-test"


def _with_offsets(ls: Any) -> Any:
    def listing(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        start = (request.query.get("startOffset") or [""])[0]
        end = (request.query.get("endOffset") or [None])[0]
        send = response.json

        def within(body: dict[str, Any]) -> None:
            items = body.get("items") or []
            body["items"] = [i for i in items if i["name"] >= start and (end is None or i["name"] < end)]
            send(body)

        response.json = within
        return ls(request, response, storage, *args, **kwargs)

    return listing


def _with_generations(get: Any) -> Any:
    def getting(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        if (request.query.get("alt") or [""])[0] == "media":
            from gcp_storage_emulator.exceptions import NotFound

            bucket, name = request.params["bucket_name"], request.params["object_id"]
            try:
                generation = storage.get_file_obj(bucket, name)["generation"]
            except NotFound:
                return get(request, response, storage, *args, **kwargs)
            response["x-goog-generation"] = generation
            if (request.query.get("ifGenerationNotMatch") or [None])[0] == generation:
                response.status = HTTPStatus.NOT_MODIFIED
                return None
        return get(request, response, storage, *args, **kwargs)

    return getting


def _gcs_error(response: Any, status: HTTPStatus, message: str, reason: str) -> None:
    """Answer as GCS answers an error: a JSON body (the emulator sends none)."""
    response.status = status
    error = {"code": status.value, "message": message, "errors": [{"message": message, "reason": reason}]}
    response.json({"error": error})


def _missing_bucket_as_gcs(ls: Any) -> Any:
    """A listing of a bucket that does not exist: 404 with GCS's JSON body, as
    from Google (the emulator sends an empty body, which TensorStore fails to parse)."""

    def listing(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        result = ls(request, response, storage, *args, **kwargs)
        if response.status == HTTPStatus.NOT_FOUND:
            _gcs_error(response, HTTPStatus.NOT_FOUND, "The specified bucket does not exist.", "notFound")
        return result

    return listing


class Gate:
    """Refuses every request with `status` (401: credentials GCS does not
    accept; 403: credentials without the permission), as GCS answers them.
    The emulator checks no credentials; the token TensorStore sends is read
    once per process, so a test refuses requests here instead."""

    status: HTTPStatus | None = None

    @classmethod
    @contextlib.contextmanager
    def refusing(cls, status: HTTPStatus) -> Iterator[None]:
        cls.status = status
        try:
            yield
        finally:
            cls.status = None

    @classmethod
    def wrap(cls, handle: Any) -> Any:
        def handling(router: Any, method: str) -> Any:
            if cls.status is None:
                return handle(router, method)
            from gcp_storage_emulator.server import Response

            response = Response(router._request_handler)
            message = {401: "Invalid Credentials", 403: "The caller does not have storage.objects.list access."}
            reason = {401: "authError", 403: "forbidden"}
            _gcs_error(response, cls.status, message[cls.status.value], reason[cls.status.value])
            response.close()
            return None

        return handling


class GcsServer:
    """The emulator, running: `url`; `environ` points TensorStore at it for a
    test; `reset` empties it (one server may serve a whole test session:
    tests/conftest.py, one per pytest worker)."""

    def __init__(self, server: Any, url: str) -> None:
        self._server, self.url = server, url

    def environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """TensorStore's `gcs` driver sent to this server, with a token, until the test ends."""
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", self.url)
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "eqx-ckpt-test-token")

    def reset(self) -> None:
        """As new: no bucket or object but an empty `BUCKET`, and no `Gate` refusing."""
        from gcp_storage_emulator.handlers import buckets

        Gate.status = None
        self._server.wipe()
        buckets.create_bucket(BUCKET, self._server._storage)


@contextlib.contextmanager
def running() -> Iterator[GcsServer]:
    """Start the emulator with an empty bucket (its handlers patched while it runs)."""
    emulator = pytest.importorskip(
        "gcp_storage_emulator.server",
        reason="gcp-storage-emulator is not installed; `pip install -e .[test]` installs it "
        "(the GCS tests need a local GCS server)",
    )
    from gcp_storage_emulator.handlers import objects

    # It logs every missing object (a normal answer to TensorStore) as an error.
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(emulator.Router, "handle", Gate.wrap(emulator.Router.handle))
        for _, handlers in emulator.HANDLERS:
            if handlers.get(emulator.GET) is objects.ls:
                monkeypatch.setitem(handlers, emulator.GET, _missing_bucket_as_gcs(_with_offsets(objects.ls)))
            elif handlers.get(emulator.GET) is objects.get:
                monkeypatch.setitem(handlers, emulator.GET, _with_generations(objects.get))
        server = emulator.create_server("127.0.0.1", 0, in_memory=True, default_bucket=BUCKET)
        server.start()
        try:
            yield GcsServer(server, "http://{}:{}".format(*server._api._httpd.server_address[:2]))
        finally:
            server.stop()
