"""A local server answering the Hugging Face Hub's HTTP API, for the calls
`huggingface_hub` makes when eqx_ckpt publishes (`push_to_hub`) and fetches
(`hf://` paths): tests point `HF_ENDPOINT` at it.

It answers, for model repositories only:

- `GET /api/models/{repo}[/revision/{rev}]`: model info (commit, privacy,
  gating, the files with their sizes and LFS ids);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: a folder's listing
  (`?recursive=true`: every file below it, as `snapshot_download` asks);
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: downloads with `X-Repo-Commit`
  and `ETag`, byte ranges (`Range: bytes=a-b`), and for LFS files a redirect
  (302, as the Hub sends to its storage) to `/blobs/{sha256}` on another
  port of this server (another origin, so huggingface_hub's `HEAD` stops at the
  redirect and reads `X-Linked-Etag` and `X-Linked-Size`, and its `GET`
  follows it, without the token, as it does to the Hub's storage);
- `POST /api/repos/create` (`visibility`; 409 with the repo's URL where it
  exists), `DELETE /api/repos/delete` (404 where there is none),
  `POST /api/models/{repo}/branch/{branch}` (from `startingPoint` or `main`),
  `POST /api/validate-yaml` (a model card's metadata: only that it parses);
- `POST /api/models/{repo}/preupload/{rev}` (files of 1 KiB or more are LFS),
  `POST /{repo}.git/info/lfs/objects/batch` (the basic transfer: one `PUT`
  of the whole object to a URL it gives), and
  `POST /api/models/{repo}/commit/{rev}` (NDJSON: header, base64 files, LFS
  files, deleted files; a header's `parentCommit` that the branch no longer
  points at is refused with 412, as the Hub does);
- `POST /api/models/{repo}/tag/{rev}` (a tag on a commit; 409 where the tag
  exists); tags resolve as revisions;
- tokens (`Authorization: Bearer`): a private repository answers 401
  without one and 404 with one that has no access (as the Hub does); a gated
  one answers 403 with `X-Error-Code: GatedRepo` to a token not granted it;
  any token may create and write a repository; a write without one is 401;
- failures injected per path (`fail(pattern, status, times, headers)`), and the bytes
  of files' contents sent counted (`sent`: by path for regular files, by
  sha256 for LFS ones, all together under `""`).

It does not answer: the Xet protocol (no `X-Xet-Hash`, no Xet token route:
clients must run with `HF_HUB_DISABLE_XET=1`, which huggingface_hub reads at
import, to upload by LFS; downloads without Xet headers use plain HTTP by
themselves), LFS multipart uploads and the LFS verify step (the batch answer
offers neither), pull requests and `refs/pr/*`, commit listings, deleted
folders and copies in a commit, `.gitignore` handling, datasets and spaces,
pagination of listings, recursive and expanded listings (last commit,
security status), the card metadata's schema, OAuth and token scopes,
`whoami`, and rate-limit headers (a 429 carries none unless `fail` is given
some). It keeps everything in memory.

`Hub.mirror = True` answers as olah 0.5.4 (a self-hosted mirror serving local
git repositories, offline) does: a model info lists file names alone (no
size, blob id or LFS data; the tree listing has them), a model info without
a revision and a missing revision are answered 401 (`RepoNotFound`), an LFS
file is sent from the same origin with its SHA-256 as its `ETag`, and a
byte range is answered with the whole file (200). `GET /api/models/{repo}/refs`
lists branches and tags in both modes.

A repository may be made hostile (`Hub.hostile[repo] = Hostile(...)`): its
model info rewritten, its files' headers and bytes replaced, ranges ignored or
answered gzip-encoded, answers delayed, dripped or never sent. Tests of the
`hf://` loader as untrusted input use it (tests/hostile/test_hub_hostile.py).

`serving()` serves one state for a `with` block; a `Server` serves for as
long as it runs (tests/conftest.py: one per pytest worker), `reset` giving
each test a new, empty state.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import http.server
import io
import json
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import yaml

LFS_FROM = 1024


@dataclasses.dataclass
class Repo:
    private: bool = False
    gated: bool = False
    # The tokens that may read it (a private or gated repo); every token may write any repo.
    readers: set[str] = dataclasses.field(default_factory=set)
    branches: dict[str, str] = dataclasses.field(default_factory=dict)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    # commit -> {path: blob sha256}
    commits: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Hostile:
    """How the server misbehaves for one repository.

    - `on`: a pattern of `METHOD path` the delays below apply to (every request
      of the repository by default).
    - `stall`: seconds waited before answering (`float("inf")`: never answers).
    - `drip`: seconds between the bytes of a file's body (1 byte at a time).
    - `info`: rewrites the model info (a dict) before it is sent.
    - `tree`: rewrites each entry of a tree listing (a dict) before it is sent.
    - `headers`: headers of a file's answer (`resolve/`), replacing the usual ones.
    - `body`: `(path, bytes) -> bytes`, the bytes served for a file.
    - `ignore_range`: a range asked for is answered with the whole file (200).
    - `bomb`: a range is answered with this many zero bytes, gzip-encoded
      (`Content-Encoding: gzip`, a small body that inflates to them).
    - `extra`: bytes sent after those of a range asked for.
    """

    on: str = ""
    stall: float = 0.0
    drip: float = 0.0
    info: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    tree: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: Callable[[str, bytes], bytes] | None = None
    ignore_range: bool = False
    bomb: int = 0
    extra: bytes = b""


class Hub:
    """The server's state: repositories, blobs, injected failures, counts."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.oids: dict[str, str] = {}  # sha256 -> git blob id
        self.failures: list[list[Any]] = []  # [pattern, status, times left]
        self.sent: dict[str, int] = {}  # path in repo -> bytes of its content sent
        self.ranges: list[tuple[str, int, int]] = []  # each range served: (path as in `sent`, first byte, end)
        self.received = 0  # bytes of files uploaded (LFS uploads and files inline in commits)
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.storage = ""  # the URL of the LFS storage's origin
        self.hostile: dict[str, Hostile] = {}  # by repository
        self.mirror = False  # answer as olah 0.5.4 does (the module docstring)

    def fail(self, pattern: str, status: int, times: int = 10**9, headers: dict[str, str] | None = None) -> None:
        """Answer the next `times` requests whose `METHOD path` matches `pattern`
        with `status` (and `headers`, such as `Retry-After`)."""
        with self.lock:
            self.failures.append([re.compile(pattern), status, times, headers or {}])

    def hostility(self, path: str) -> tuple[str, Hostile] | None:
        """The repository a request's path is about, and how it misbehaves (`None`: it does not)."""
        m = re.match(r"/(?:api/models/)?([^/]+/[^/]+)/(?:resolve|revision|tree)/", path + "/") or re.fullmatch(
            r"/api/models/([^/]+/[^/]+)/?", path
        )
        if m and m[1] in self.hostile:
            return m[1], self.hostile[m[1]]
        m = re.fullmatch(r"/blobs/([0-9a-f]{64})", path)
        for name, hostile in self.hostile.items() if m else ():
            if any(m[1] in files.values() for files in self.repos[name].commits.values()):
                return name, hostile
        return None

    def put_files(self, repo: str, files: dict[str, bytes], branch: str = "main", **options: Any) -> str:
        """A commit of `files` on `branch` (the repo made with `options` where there is none): its id."""
        with self.lock:
            entry = self.repos.setdefault(repo, Repo(**options))
            base = dict(entry.commits.get(entry.branches.get(branch, ""), {}))
            for path, data in files.items():
                base[path] = self._blob(data)
            return self._commit(entry, branch, base)

    def git_oid(self, oid: str) -> str:
        """A blob's git id, worked out once (a large file's is seconds of hashing)."""
        with self.lock:
            found = self.oids.get(oid)
        if found is None:
            found = _git_oid(self.blobs[oid])
            with self.lock:
                self.oids[oid] = found
        return found

    def _blob(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        self.blobs[oid] = data
        return oid

    def _commit(self, repo: Repo, branch: str, files: dict[str, str]) -> str:
        sha = hashlib.sha1(json.dumps([branch, sorted(files.items()), len(repo.commits)]).encode()).hexdigest()
        repo.commits[sha] = files
        repo.branches[branch] = sha
        return sha

    def resolve(self, repo: Repo, revision: str) -> str | None:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.tags:
            return repo.tags[revision]
        return revision if revision in repo.commits else None


class Handler(http.server.BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def parse_request(self) -> bool:
        # The state served now, taken as each request arrives: one still being
        # answered when `Server.reset` swaps the state (a stalled one, say)
        # keeps to the state it began with, and a kept-alive connection's next
        # request gets the new one.
        self.hub = type(self).hub
        return super().parse_request()

    # --- plumbing ---

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, length: int | None = None
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # (a client that stopped reading)
                self.wfile.write(body)

    def _json(self, value: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json({"error": message}, status, headers)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _injected(self) -> bool:
        line = f"{self.command} {self.path}"
        found = self.hub.hostility(urllib.parse.urlsplit(self.path).path)
        if found is not None and found[1].stall and re.search(found[1].on, line):
            if found[1].stall == float("inf"):
                self.close_connection = True
                threading.Event().wait(600)  # (the client gives up; the daemon thread ends with the process)
                return True
            time.sleep(found[1].stall)
        with self.hub.lock:
            self.hub.requests.append(line)
            for failure in self.hub.failures:
                if failure[2] > 0 and failure[0].search(line):
                    failure[2] -= 1
                    status, headers = failure[1], failure[3]
                    break
            else:
                return False
        self._body()
        self._json({"error": f"injected {status}"}, status, {"X-Error-Message": f"injected {status}", **headers})
        return True

    def _readable(self, name: str) -> Repo | None:
        """The repo, or `None` once an error was sent (as the Hub answers)."""
        repo = self.hub.repos.get(name)
        token = self._token()
        if repo is None or (repo.private and token is not None and token not in repo.readers):
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.private and token is None:
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        if repo.gated and token not in repo.readers:
            self._error(
                403, "GatedRepo", "Access to this model is restricted. You must be authenticated and granted access."
            )
            return None
        return repo

    def _revision(self, name: str, repo: Repo, revision: str | None) -> str | None:
        sha = None if revision is None else self.hub.resolve(repo, urllib.parse.unquote(revision))
        if sha is None and self.hub.mirror:  # (olah: a revision it cannot find, or none named)
            self._error(401, "RepoNotFound", "Repository not found")
        elif sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    # --- routes ---

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if self._injected():
            return
        path = urllib.parse.urlsplit(self.path).path
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._info(m[1], m[2] or (None if self.hub.mirror else "main"))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/refs", path)
        if m:
            return self._refs(m[1])
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)/?(.*)", path)
        if m:
            recursive = "recursive=true" in urllib.parse.urlsplit(self.path).query.lower()
            return self._tree(m[1], m[2], urllib.parse.unquote(m[3]), recursive)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(m[1], m[2], urllib.parse.unquote(m[3]))
        m = re.fullmatch(r"/blobs/([0-9a-f]{64})", path)
        if m and m[1] in self.hub.blobs:
            return self._content(self.hub.blobs[m[1]], {"ETag": f'"{m[1]}"'}, m[1])
        self._error(404, None, f"no route {path}")

    def _files(self, repo: Repo, sha: str) -> list[dict[str, Any]]:
        out = []
        for p, oid in sorted(repo.commits[sha].items()):
            data = self.hub.blobs[oid]
            entry: dict[str, Any] = {"rfilename": p, "size": len(data), "blobId": self.hub.git_oid(oid)}
            if len(data) >= LFS_FROM:
                entry["lfs"] = {"sha256": oid, "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def _refs(self, name: str) -> None:
        repo = self._readable(name)
        if repo is not None:
            refs = {
                kind: [
                    {"name": n, "ref": f"refs/{kind[:-1] if kind == 'tags' else 'heads'}/{n}", "targetCommit": sha}
                    for n, sha in sorted(getattr(repo, kind).items())
                ]
                for kind in ("branches", "tags")
            }
            self._json({**refs, "converts": []})

    def _info(self, name: str, revision: str | None) -> None:
        repo = self._readable(name)
        sha = repo and self._revision(name, repo, revision)
        if repo is None or sha is None:
            return
        hostile = self.hub.hostile.get(name)
        info = {
            "id": name,
            "_id": name,
            "modelId": name,
            "sha": sha,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [{"rfilename": f["rfilename"]} if self.hub.mirror else f for f in self._files(repo, sha)],
        }
        self._json(hostile.info(info) if hostile is not None and hostile.info is not None else info)

    def _tree(self, name: str, revision: str, folder: str, recursive: bool = False) -> None:
        repo = self._readable(name)
        sha = repo and self._revision(name, repo, revision)
        if repo is None or sha is None:
            return
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        out, dirs = [], set()
        for entry in self._files(repo, sha):
            p = entry["rfilename"]
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            item = {"type": "file", "path": p, "size": entry["size"], "oid": entry["blobId"]}
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"], "pointerSize": 134}
            out.append(item)
        if prefix and not out and not dirs:
            return self._error(404, "EntryNotFound", f"{folder} does not exist")
        hostile = self.hub.hostile.get(name)
        out = [hostile.tree(e) for e in out] if hostile is not None and hostile.tree is not None else out
        self._json([{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(dirs)] + out)

    def _resolve(self, name: str, revision: str, file: str) -> None:
        repo = self._readable(name)
        sha = repo and self._revision(name, repo, revision)
        if repo is None or sha is None:
            return
        oid = self.hub.repos[name].commits[sha].get(file)
        if oid is None:
            return self._error(404, "EntryNotFound", f"{file} does not exist at {sha}")
        data = self.hub.blobs[oid]
        headers = {"X-Repo-Commit": sha}
        if len(data) >= LFS_FROM and self.hub.mirror:  # (from the same origin, named by its SHA-256)
            return self._content(data, {**headers, "ETag": f'"{oid}"', **self._hostile_headers(name)}, oid)
        if len(data) >= LFS_FROM:
            # The storage's own origin (another port of this server), as the Hub's
            # storage is another host: a HEAD stops at the redirect, a GET follows it.
            location = f"{self.hub.storage}/blobs/{oid}"
            headers.update({"Location": location, "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(len(data))})
            headers["ETag"] = f'"{self.hub.git_oid(oid)}"'
            return self._send(302, b"", {**headers, **self._hostile_headers(name)})
        headers["ETag"] = f'"{self.hub.git_oid(oid)}"'
        self._content(data, {**headers, **self._hostile_headers(name)}, file)

    def _hostile_headers(self, name: str) -> dict[str, str]:
        hostile = self.hub.hostile.get(name)
        return dict(hostile.headers) if hostile is not None else {}

    def _content(self, data: bytes, headers: dict[str, str], counted: str) -> None:
        """The bytes, or the range asked for; their count added to `sent`."""
        found = self.hub.hostility(urllib.parse.urlsplit(self.path).path)
        hostile = found[1] if found is not None else Hostile()
        if hostile.body is not None:
            data = hostile.body(counted, data)
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        status, body = 200, data
        if m and not hostile.ignore_range and not self.hub.mirror:
            start = int(m[1]) if m[1] else max(len(data) - int(m[2]), 0)
            end = min(int(m[2]) + 1, len(data)) if m[1] and m[2] else len(data)
            if start >= len(data):
                return self._error(416, None, "Range Not Satisfiable")
            status, body = 206, data[start:end] + hostile.extra
            if self.command != "HEAD":
                with self.hub.lock:
                    self.hub.ranges.append((counted, start, end))
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
            if hostile.bomb:
                body, headers["Content-Encoding"] = _bomb(hostile.bomb), "gzip"
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if self.command == "HEAD":
            return self._send(status, b"", headers, length=len(body))
        with self.hub.lock:
            self.hub.sent[counted] = self.hub.sent.get(counted, 0) + len(body)
            self.hub.sent[""] = self.hub.sent.get("", 0) + len(body)
        if hostile.drip:
            self._send(status, b"", headers, length=len(body))
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(hostile.drip)
            return
        self._send(status, body, headers)

    def do_PUT(self) -> None:
        if self._injected():
            return
        m = re.fullmatch(r"/upload/([0-9a-f]{64})", urllib.parse.urlsplit(self.path).path)
        data = self._body()
        if m is None or hashlib.sha256(data).hexdigest() != m[1]:
            return self._error(400, None, "bad upload")
        with self.hub.lock:
            self.hub.blobs[m[1]] = data
            self.hub.received += len(data)
        self._send(200)

    def do_DELETE(self) -> None:
        if self._injected():
            return
        body = json.loads(self._body() or b"{}")
        if urllib.parse.urlsplit(self.path).path != "/api/repos/delete" or self._token() is None:
            return self._error(404 if self._token() else 401, None, "no route, or no token")
        with self.hub.lock:
            if self.hub.repos.pop(f"{body.get('organization') or 'user'}/{body.get('name')}", None) is None:
                return self._error(404, "RepoNotFound", "Repository not found")
        self._json({})

    def do_POST(self) -> None:
        if self._injected():
            return
        path = urllib.parse.urlsplit(self.path).path
        if self._token() is None:
            self._body()
            return self._error(401, None, "Invalid credentials in Authorization header")
        if path == "/api/repos/create":
            return self._create(json.loads(self._body()))
        if path == "/api/validate-yaml":
            return self._validate(json.loads(self._body())["content"])
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(branch|tag|preupload|commit)/([^/]+)", path)
        if m and m[1] not in self.hub.repos:
            self._body()
            return self._error(404, "RepoNotFound", "Repository not found")
        if m and m[2] == "branch":
            return self._branch(m[1], urllib.parse.unquote(m[3]), self._body())
        if m and m[2] == "tag":
            return self._tag(m[1], urllib.parse.unquote(m[3]), json.loads(self._body()))
        if m and m[2] == "preupload":
            files = json.loads(self._body())["files"]
            modes = [
                {"path": f["path"], "uploadMode": "lfs" if f["size"] >= LFS_FROM else "regular", "shouldIgnore": False}
                for f in files
            ]
            return self._json({"files": modes})
        if m and m[2] == "commit":
            return self._commit(m[1], urllib.parse.unquote(m[3]), self._body())
        m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if m:
            return self._batch(json.loads(self._body()))
        self._body()
        self._error(404, None, f"no route {path}")

    def _create(self, body: dict[str, Any]) -> None:
        name = f"{body.get('organization') or 'user'}/{body['name']}"
        with self.hub.lock:
            if name in self.hub.repos:  # the Hub's answer carries the repo's URL
                url = f"http://{self.headers['Host']}/{name}"
                return self._json({"error": "You already created this model repo", "url": url}, 409)
            private = body.get("visibility", "private" if body.get("private") else "public") != "public"
            self.hub.repos[name] = Repo(private=private, readers={self._token() or ""})
            self.hub._commit(self.hub.repos[name], "main", {})
        self._json({"url": f"http://{self.headers['Host']}/{name}", "name": name, "id": name})

    def _validate(self, card: str) -> None:
        """A model card's metadata: a YAML mapping between `---` lines (the Hub
        checks its fields too; this server only that it parses)."""
        m = re.match(r"---\n(.*?)\n---\n", card, re.S)
        try:
            ok = m is not None and isinstance(yaml.safe_load(m[1]), dict)
        except yaml.YAMLError:
            ok = False
        if not ok:
            return self._error(400, None, "Invalid metadata in README.md")
        self._json({"errors": [], "warnings": []})

    def _branch(self, name: str, branch: str, body: bytes) -> None:
        with self.hub.lock:
            repo = self.hub.repos[name]
            if branch in repo.branches:
                return self._error(409, None, "Reference already exists")
            start = (json.loads(body) if body else {}).get("startingPoint") or "main"
            repo.branches[branch] = self.hub.resolve(repo, start) or repo.branches["main"]
        self._json({})

    def _tag(self, name: str, revision: str, body: dict[str, Any]) -> None:
        with self.hub.lock:
            repo = self.hub.repos[name]
            sha = self.hub.resolve(repo, revision)
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            if body["tag"] in repo.tags:
                return self._error(409, None, "Tag already exists")
            repo.tags[body["tag"]] = sha
        self._json({})

    def _batch(self, body: dict[str, Any]) -> None:
        base = f"http://{self.headers['Host']}"
        objects = []
        for obj in body["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.blobs:
                entry["actions"] = {"upload": {"href": f"{base}/upload/{obj['oid']}"}}
            objects.append(entry)
        self._json({"transfer": "basic", "objects": objects})

    def _commit(self, name: str, revision: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        with self.hub.lock:
            repo = self.hub.repos[name]
            if revision not in repo.branches:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            files = dict(repo.commits[repo.branches[revision]])
            for line in lines:
                value = line["value"]
                if line["key"] == "header" and value.get("parentCommit") not in (None, repo.branches[revision]):
                    return self._error(412, None, "A commit has happened since. Please refresh and try again.")
                if line["key"] == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        return self._error(404, "EntryNotFound", f"{value['path']} does not exist")
                elif line["key"] == "file":
                    content = base64.b64decode(value["content"])
                    self.hub.received += len(content)
                    files[value["path"]] = self.hub._blob(content)
                elif line["key"] == "lfsFile":
                    if value["oid"] not in self.hub.blobs:
                        return self._error(422, None, f"LFS object {value['oid']} was not uploaded")
                    files[value["path"]] = value["oid"]
            sha = self.hub._commit(repo, revision, files)
        url = f"http://{self.headers['Host']}/{name}/commit/{sha}"
        self._json({"success": True, "commitOid": sha, "commitUrl": url})


@functools.lru_cache(maxsize=4)
def _bomb(size: int) -> bytes:
    """`size` zero bytes, gzip-compressed (about a thousandth of it)."""
    out, zero = io.BytesIO(), bytes(2**24)
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as f:
        for _ in range(size // len(zero)):
            f.write(zero)
        f.write(bytes(size % len(zero)))
    return out.getvalue()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Server:
    """A `Hub` served on 127.0.0.1 (the API on `port`, its LFS storage on
    another): `url`, and `hub`, the state it answers from, which `reset`
    replaces with a new, empty one (so that the tests sharing one server see
    nothing of each other's repositories, failures, hostility or counts)."""

    def __init__(self, hub: Hub | None = None, port: int = 0) -> None:
        self._handler = type("BoundHandler", (Handler,), {"hub": hub if hub is not None else Hub()})
        self._servers = [http.server.ThreadingHTTPServer(("127.0.0.1", p), self._handler) for p in (port, 0)]
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.storage = f"http://127.0.0.1:{self._servers[1].server_address[1]}"
        self.hub.storage = self.storage
        self._threads = []
        for server in self._servers:
            server.daemon_threads = True
            # (`shutdown` waits for the loop to look again: a tenth of the default half second)
            self._threads.append(threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True))
            self._threads[-1].start()

    @property
    def hub(self) -> Hub:
        return self._handler.hub

    def reset(self) -> Hub:
        """A new, empty state served from now on (each request takes the state
        once, as it begins: `Handler.handle_one_request`); returns it."""
        hub = Hub()
        hub.storage = self.storage
        self._handler.hub = hub
        return hub

    def stop(self) -> None:
        """Both ports closed: a later connection to either is refused."""
        for server, thread in zip(self._servers, self._threads):
            server.shutdown()
            server.server_close()
            thread.join()


@contextlib.contextmanager
def serving(hub: Hub | None = None, port: int = 0) -> Iterator[tuple[str, Hub]]:
    """Serve a `Hub` on 127.0.0.1 (the API on `port`, its LFS storage on
    another), yielding the API's URL and the state; on leaving, both ports are closed."""
    server = Server(hub, port)
    try:
        yield server.url, server.hub
    finally:
        server.stop()


if __name__ == "__main__":  # `python tests/support/hub_server.py PORT`: serve until killed (benchmarks/hub.py)
    with serving(port=int(sys.argv[1])) as (url, _):
        print(url, flush=True)
        threading.Event().wait()
