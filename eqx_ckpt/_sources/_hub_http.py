"""What a Hub server may answer, checked on `huggingface_hub`'s own HTTP client.

A server reached through `HF_ENDPOINT` is trusted with the bytes of the files
it serves, not with anything that names a path, bounds a wait or sizes memory
(docs/sharing.md, "Trust and bounds"). A refusal is a `CheckpointStorageError`
(a stall a `CheckpointConnectionError`) raised inside the library's call, so
it writes nothing. Every eqx_ckpt Hub call hooks the checks on the library's
shared client (`guarded`: a user may replace the client); they apply only to
requests made inside `guarded` or marked with the header `MARK`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from .._base import _state
from .._base._errors import CheckpointConnectionError, CheckpointStorageError, from_file

# The longest wait a server's `Retry-After` (or rate-limit reset) is honoured for.
MAX_RETRY_AFTER = 5
# The slowest a body may arrive once a timeout has passed, in bytes a second.
MIN_RATE = 16 * 2**10
# The most bytes of one API answer (model info, a listing).
MAX_API = 64 * 2**20
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")

# The header that marks a request as eqx_ckpt's (removed before it is sent).
MARK = "x-eqx-ckpt"
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("eqx_ckpt_hub_call", default=False)
# Each request tried and not yet answered for good, by (thread, method, URL):
# when it was last tried, and whether the server answered that try (429, 5xx).
# Its lock also guards hooking the client.
_TRIES: _state.Table[tuple[int, str, str], tuple[float, bool]] = _state.table(
    "hub_http.tries", 1024, "oldest", fork="empty"
)


def timeout() -> float:
    import huggingface_hub.constants

    return float(huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT)


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """The checks on, for the Hub requests this thread makes inside."""
    _hook()
    inside = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(inside)


def _hook() -> None:
    """Hook the checks on `huggingface_hub`'s shared client, unless they are on it."""
    import huggingface_hub

    client = huggingface_hub.get_session()
    with _TRIES.lock:
        hooks = client.event_hooks
        if _on_request not in hooks["request"]:
            client.event_hooks = {
                "request": [*hooks["request"], _on_request],
                "response": [*hooks["response"], _on_response],
            }


def _ours(request: Any) -> bool:
    """Whether eqx_ckpt made `request` (a redirect keeps the mark in its extensions)."""
    if request.headers.pop(MARK, None) is not None or _INSIDE.get():
        request.extensions["eqx_ckpt"] = True
    return bool(request.extensions.get("eqx_ckpt"))


def _server(url: Any) -> str:
    return f"{url.scheme}://{url.host}" + (f":{url.port}" if url.port else "")


def _on_request(request: Any) -> None:
    if not _ours(request):
        return
    limit = timeout()
    asked = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: min(v, limit) if isinstance(v, (int, float)) else limit
        for k, v in {k: asked.get(k) for k in ("connect", "read", "write", "pool")}.items()
    }
    if "range" in request.headers:
        request.headers["Accept-Encoding"] = "identity"
    key, now = (threading.get_ident(), request.method, str(request.url)), time.monotonic()
    with _TRIES.lock:
        last, answered = _TRIES.get(key, (0.0, True))
        _TRIES.put(key, (now, False))
    # A retry of a try that got no answer in time (not a new call, made later).
    if not answered and now - last < 2 * limit + MAX_RETRY_AFTER:
        _TRIES.pop(key, None)
        raise CheckpointConnectionError(
            f"{_server(request.url)} did not answer {request.method} {from_file(request.url.path)} within "
            f"{limit:g} s (`HF_HUB_DOWNLOAD_TIMEOUT`), so it was given up. Check the network and `HF_ENDPOINT`; "
            f"a model loaded whole once loads offline (`HF_HUB_OFFLINE=1`).",
            path=_server(request.url),
        )


def _on_response(response: Any) -> None:
    request = response.request
    if not request.extensions.get("eqx_ckpt"):
        return
    key = (threading.get_ident(), request.method, str(request.url))
    if response.status_code < 500 and response.status_code != 429:
        _TRIES.pop(key, None)
    else:
        _TRIES.put(key, (time.monotonic(), True))
    _cap_waits(response)
    _check_names(response)
    limit = _checked_range(response)
    if limit is None and "/api/" in request.url.path:
        limit = MAX_API
    response.stream = _bounded()(response, limit)


def _cap_waits(response: Any) -> None:
    """A `Retry-After` (or a rate-limit reset) honoured for `MAX_RETRY_AFTER` seconds at most."""
    headers = response.headers
    for name in ("ratelimit", "ratelimit-policy"):
        if name in headers:
            del headers[name]
    if "retry-after" in headers:
        said = headers["retry-after"].strip()
        if said.isdigit():
            headers["retry-after"] = str(min(int(said), MAX_RETRY_AFTER))
        else:
            del headers["retry-after"]


def _check_names(response: Any) -> None:
    """Refuse a commit or an ETag that is not what the Hub sends: the library names files after them."""
    headers = response.headers
    commit = headers.get("x-repo-commit")
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise _refused(response, f"the commit `X-Repo-Commit: {from_file(commit)}`, which is no commit id")
    if "/resolve/" not in response.request.url.path:
        return
    for name in ("x-linked-etag", "etag"):
        etag = headers.get(name)
        plain = etag.removeprefix("W/").strip('"') if etag is not None else None
        if plain is not None and not _ETAG.fullmatch(plain):
            raise _refused(response, f"the file's `{name}: {from_file(etag)}`, which is no git blob id nor SHA-256")


def _checked_range(response: Any) -> int | None:
    """The most bytes the answer to a byte range may hold (`None`: not a range)."""
    asked = _RANGE.fullmatch(response.request.headers.get("range", "").strip())
    if asked is None or response.status_code >= 300 or response.is_redirect:
        return None
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise _refused(response, f"a byte range encoded as `{from_file(encoding)}`, which was asked for unencoded")
    if response.status_code != 206:
        server, path = _server(response.request.url), from_file(response.request.url.path)
        raise RangeIgnored(
            f"{server} answers a byte range of {path} with HTTP {response.status_code} (the whole file): it ignores "
            f"`Range`.",
            path=server,
        )
    return int(asked[2]) - int(asked[1]) + 1 if asked[2] else None


def _refused(response: Any, what: str) -> CheckpointStorageError:
    server = _server(response.request.url)
    return CheckpointStorageError(
        f"{server} answered {from_file(response.request.url.path)} with {what}, so nothing of it was used or written. "
        f"It does not answer as the Hugging Face Hub does: check `HF_ENDPOINT` (a mirror or proxy answering for the "
        f"Hub).",
        path=server,
    )


class RangeIgnored(CheckpointStorageError):
    """A byte range answered with the whole file (`_hub.Files` then downloads whole files)."""


@_state.memo(1)
def _bounded() -> type:
    """The class of a bounded body (a stream of the library's HTTP client, imported with it)."""
    import httpx2

    class Bounded(httpx2.SyncByteStream):
        """A response's body, refused past `limit` bytes, or where it arrives
        slower than `MIN_RATE` once a timeout has passed."""

        def __init__(self, response: Any, limit: int | None):
            self.response, self.stream, self.limit = response, response.stream, limit

        def __iter__(self) -> Iterator[bytes]:
            start, got, slow = time.monotonic(), 0, timeout()
            for chunk in self.stream:
                got += len(chunk)
                if self.limit is not None and got > self.limit:
                    raise _refused(self.response, f"more than the {self.limit} bytes asked for")
                took = time.monotonic() - start
                if took > slow and got < MIN_RATE * took:
                    raise _slow(self.response, got, took)
                yield chunk

        def close(self) -> None:
            self.stream.close()

    return Bounded


def _slow(response: Any, got: int, took: float) -> CheckpointConnectionError:
    server = _server(response.request.url)
    return CheckpointConnectionError(
        f"{server} sent {got} bytes of {from_file(response.request.url.path)} in {took:.0f} s, slower than "
        f"{MIN_RATE} bytes a second, so it was given up. Check the network and `HF_ENDPOINT`.",
        path=server,
    )
