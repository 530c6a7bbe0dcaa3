"""A local stand-in for the Hugging Face Hub (stdlib http.server, threaded), with faults a test switches on.

It serves what huggingface_hub and engine.hub use: GET /api/models/{repo}[/revision/{rev}] (siblings with
size, blobId and lfs.sha256 when ?blobs=true), POST /api/models/{repo}/paths-info/{rev},
GET /api/models/{repo}/tree/{rev}, and HEAD/GET /{repo}/resolve/{rev}/{path} (X-Repo-Commit, ETag,
X-Linked-Etag, X-Linked-Size). LFS files redirect to a second listener (the "CDN", another origin, like the
real Hub's signed URLs) so a test can check the token never reaches it. Both honour Range.

Faults (HubServer.faults) make it hostile: drops, corruption, stalls, ignored or wrong Ranges, 5xx forever,
bodies and listings that never end, redirect loops, and listings rewritten with hostile names, hashes and
sizes. Every loop in here is bounded (FLOOD_BYTES, the stop event), so a test that fails cannot hang the server.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

LFS_THRESHOLD = 100_000  # files at least this big are served as LFS (sha256, CDN redirect)
CHUNK = 64 * 1024
FLOOD_BYTES = 64 * 1024**2  # an "endless" body ends here: twice the client's listing cap


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = ""
    gated: bool = False  # repo info is public, files need the token (401/403 GatedRepo)
    private: bool = False  # everything needs the token (401 RepoNotFound without it)
    revisions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.update(self.files)

    def update(self, files: dict[str, bytes]) -> None:
        """New contents, as a new commit that `main` points at."""
        self.files = dict(files)
        digest = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))
                              .encode()).hexdigest()
        self.commit = digest
        self.revisions = {"main": digest, digest: digest}

    def is_lfs(self, path: str) -> bool:
        return len(self.files[path]) >= LFS_THRESHOLD

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def pointer(self, path: str) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256(path)}\n"
                f"size {len(self.files[path])}\n").encode()

    def sibling(self, path: str, with_sizes: bool) -> dict:
        data = self.files[path]
        entry = {"rfilename": path}
        if with_sizes:
            entry["size"] = len(data)
            if self.is_lfs(path):
                entry["blobId"] = git_blob_sha1(self.pointer(path))
                entry["lfs"] = {"size": len(data), "sha256": self.sha256(path), "pointerSize": len(self.pointer(path))}
            else:
                entry["blobId"] = git_blob_sha1(data)
        return entry

    def tree_entry(self, path: str) -> dict:
        data = self.files[path]
        entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
        if self.is_lfs(path):
            entry["oid"] = git_blob_sha1(self.pointer(path))
            entry["lfs"] = {"oid": self.sha256(path), "size": len(data), "pointerSize": len(self.pointer(path))}
        return entry


@dataclass
class Faults:
    """Per repo-file faults. Counts are consumed by GET requests of the bytes."""
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> cut the body after N bytes (once)
    corrupt: dict[str, int] = field(default_factory=dict)  # path -> flip one byte in the next N responses
    stall: dict[str, tuple[int, float]] = field(default_factory=dict)  # path -> (after N bytes, sleep s) once
    chunk_delay_s: float = 0.0  # slow server: sleep between 16 KB chunks
    ignore_range: bool = False  # answer 200 with the whole file to a Range request
    status: dict[str, list[int]] = field(default_factory=dict)  # path -> statuses to answer first (e.g. 503)
    no_sizes: bool = False  # repo info without sizes (an older server): the client must ask paths-info
    api_delay_s: float = 0.0  # the repo info answer waits this long (a silent network)
    cut_every: dict[str, int] = field(default_factory=dict)  # path -> every response of it ends after N bytes
    status_always: dict[str, int] = field(default_factory=dict)  # path -> this status for every GET (500 forever)
    wrong_range: bool = False  # a Range request gets 206 with a Content-Range that starts one byte later
    flood_files: set[str] = field(default_factory=set)  # bodies that go on past the file (no Content-Length)
    flood_listing: bool = False  # the repo info never ends (an endless JSON array, up to FLOOD_BYTES)
    flood_errors: bool = False  # error answers carry an endless body
    listing_patch: Callable[[dict], dict] | None = None  # rewrites the repo info (hostile names, hashes, sizes)
    listing_raw: bytes | None = None  # the repo info's exact bytes (JSON nested 100,000 deep, not JSON at all)
    redirect: dict[str, str] = field(default_factory=dict)  # path -> Location its resolve answers (loops, schemes)
    trickle_s: float = 0.0  # one byte per this many seconds, forever (bounded by the stop event)


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str  # URL path
    file: str | None  # repo file it is about
    range_start: int | None
    auth: str | None  # the Authorization header


class HubServer:
    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.faults = Faults()
        self.requests: list[Request] = []
        self.flood_sent: list[int] = []  # bytes each endless body had sent when the client hung up
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._servers: list[ThreadingHTTPServer] = []

    # --- setup ----------------------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        repo = Repo(repo_id, files, **kw)
        self.repos[repo_id] = repo
        return repo

    def start(self) -> HubServer:
        for name in ("hub", "cdn"):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, name))
            srv.daemon_threads = True
            srv.block_on_close = False
            self._servers.append(srv)
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    # --- what the tests look at -----------------------------------------------------------------------------
    def gets(self, file: str) -> list[Request]:
        """GET requests that carried bytes of `file` (the CDN's for LFS files, the hub's otherwise)."""
        return [r for r in self.requests if r.method == "GET" and r.file == file
                and (r.server == "cdn" or "/resolve/" in r.path)]

    def log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def take(self, table: dict, key: str):
        """Consume one use of a fault: counts go down, one-shot entries disappear."""
        with self._lock:
            value = table.get(key)
            if value is None:
                return None
            if isinstance(value, list):
                out = value.pop(0)
                if not value:
                    del table[key]
                return out
            if isinstance(value, int) and table is self.faults.corrupt:
                table[key] = value - 1
                if table[key] <= 0:
                    del table[key]
                return value
            del table[key]
            return value


def _handler(hub: HubServer, name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # --- plumbing -----------------------------------------------------------------------------------
        def _json(self, status: int, data, headers: dict | None = None) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str) -> None:
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if hub.faults.flood_errors and self.command != "HEAD":
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                self._flood(b'{"error": "' + b"x" * (CHUNK - 12))
                return
            self._json(status, {"error": message}, headers)

        def _flood(self, first: bytes, filler: bytes = b"x" * CHUNK) -> None:
            """A body without a length that goes on until FLOOD_BYTES, the client leaving, or the server stopping."""
            self.close_connection = True
            sent = 0
            try:
                self.wfile.write(first)
                while sent < FLOOD_BYTES and not hub._stopping.is_set():
                    self.wfile.write(filler)
                    sent += len(filler)
            except OSError:
                pass
            with hub._lock:
                hub.flood_sent.append(sent)

        def _range_start(self) -> int | None:
            m = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
            return int(m[1]) if m else None

        def _record(self, file: str | None) -> None:
            hub.log(Request(name, self.command, urlparse(self.path).path, file, self._range_start(),
                            self.headers.get("Authorization")))

        def _authorized(self) -> bool | None:
            """True: the right token; False: a wrong one; None: none."""
            auth = self.headers.get("Authorization")
            if not auth:
                return None
            return hub.token is not None and auth == f"Bearer {hub.token}"

        def _repo_or_error(self, repo_id: str, revision: str | None, files_need_token: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            auth = self._authorized()
            if auth is False:
                self._error(401, None, "Invalid credentials in Authorization header")
                return None
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.private and not auth:
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if files_need_token and repo.gated and not auth:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted; you must be authenticated")
                return None
            if revision is not None and revision not in repo.revisions:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None
            return repo

        # --- the bytes, with faults ---------------------------------------------------------------------
        def _send_bytes(self, file: str, data: bytes, extra: dict) -> None:
            status_fault = hub.take(hub.faults.status, file) if self.command == "GET" else None
            if self.command == "GET" and file in hub.faults.status_always:
                status_fault = hub.faults.status_always[file]
            if status_fault:
                self._error(status_fault, None, "injected fault")
                return
            if file in hub.faults.flood_files and self.command == "GET":
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self._flood(data)
                return
            if hub.faults.trickle_s and self.command == "GET":
                return self._trickle(data)
            start = self._range_start()
            if start is not None and hub.faults.wrong_range:
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start + 1}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start - 1))
                self.end_headers()
                self.wfile.write(data[start + 1:])
                return
            if hub.faults.ignore_range or start is None:
                start = None
            if start is not None and start >= len(data) > 0:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[start or 0:]
            self.send_response(206 if start is not None else 200)
            for k, v in extra.items():
                self.send_header(k, v)
            if start is not None:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if hub.take(hub.faults.corrupt, file) and body:
                body = bytearray(body)
                body[len(body) // 2] ^= 0xFF
                body = bytes(body)
            drop = hub.take(hub.faults.drop_after, file)
            if file in hub.faults.cut_every:
                drop = hub.faults.cut_every[file]
            stall = hub.take(hub.faults.stall, file)
            step = 16 * 1024 if hub.faults.chunk_delay_s else CHUNK
            sent = 0
            try:
                while sent < len(body):
                    n = step
                    if drop is not None:
                        n = min(n, drop - sent)
                        if n <= 0:  # cut the connection mid-body, as a dropped network would
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return
                    if stall is not None and sent >= stall[0]:
                        hub._stopping.wait(stall[1])
                        stall = None
                    self.wfile.write(body[sent:sent + n])
                    sent += n
                    if hub.faults.chunk_delay_s:
                        self.wfile.flush()
                        time.sleep(hub.faults.chunk_delay_s)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self.close_connection = True

        def _trickle(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                for i in range(len(data)):
                    if hub._stopping.wait(hub.faults.trickle_s):
                        break
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
            except OSError:
                self.close_connection = True

        # --- routes -------------------------------------------------------------------------------------
        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            url = urlparse(self.path)
            if name == "cdn":
                return self._cdn(url.path)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", url.path)
            if m:
                self._record(None)
                hub._stopping.wait(hub.faults.api_delay_s)
                revision = unquote(m[2]) if m[2] else "main"
                repo = self._repo_or_error(m[1], revision, files_need_token=False)
                if repo:
                    blobs = parse_qs(url.query).get("blobs") == ["True"] or "blobs=true" in url.query.lower()
                    with_sizes = blobs and not hub.faults.no_sizes
                    if hub.faults.listing_raw is not None:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(hub.faults.listing_raw)))
                        self.end_headers()
                        self.wfile.write(hub.faults.listing_raw)
                        return
                    if hub.faults.flood_listing:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        self._flood(b'{"siblings": [', b'{"rfilename": "x"},' * 3000)
                        return
                    info = {"_id": repo.commit[:24], "id": repo.repo_id, "modelId": repo.repo_id,
                            "sha": repo.revisions[revision], "private": repo.private,
                            "gated": "auto" if repo.gated else False, "disabled": False, "tags": [],
                            "siblings": [repo.sibling(p, with_sizes) for p in sorted(repo.files)]}
                    self._json(200, hub.faults.listing_patch(info) if hub.faults.listing_patch else info)
                return
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", url.path)
            if m:
                self._record(None)
                repo = self._repo_or_error(m[1], unquote(m[2]), files_need_token=False)
                if repo:
                    self._json(200, [repo.tree_entry(p) for p in sorted(repo.files)])
                return
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path)
            if m:
                return self._resolve(m[1], unquote(m[2]), unquote(m[3]))
            self._record(None)
            self._error(404, None, f"no route {url.path}")

        def do_POST(self):
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode()) if length else {}
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", url.path)
            self._record(None)
            if name != "hub" or not m:
                return self._error(404, None, f"no route {url.path}")
            repo = self._repo_or_error(m[1], unquote(m[2]), files_need_token=False)
            if repo:
                self._json(200, [repo.tree_entry(p) for p in form.get("paths", []) if p in repo.files])

        def _resolve(self, repo_id: str, revision: str, path: str) -> None:
            self._record(path)
            repo = self._repo_or_error(repo_id, revision, files_need_token=True)
            if repo is None:
                return
            if path not in repo.files:
                return self._error(404, "EntryNotFound", f"{path} does not exist at {revision}")
            data = repo.files[path]
            commit = repo.revisions[revision]
            if path in hub.faults.redirect:
                self.send_response(302)
                self.send_header("Location", hub.faults.redirect[path])
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if repo.is_lfs(path):
                sha = repo.sha256(path)
                self.send_response(302)
                for k, v in {"Location": f"{hub.cdn}/cdn/{sha}?signature=test", "X-Repo-Commit": commit,
                             "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                             "ETag": f'"{git_blob_sha1(repo.pointer(path))}"', "Content-Length": "0"}.items():
                    self.send_header(k, v)
                self.end_headers()
                return
            self._send_bytes(path, data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"'})

        def _cdn(self, path: str) -> None:
            m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
            found = None
            if m:
                for repo in hub.repos.values():
                    for p in repo.files:
                        if repo.is_lfs(p) and repo.sha256(p) == m[1]:
                            found = (p, repo.files[p])
            self._record(found[0] if found else None)
            if not found:
                return self._error(404, None, "no such blob")
            self._send_bytes(found[0], found[1], {"ETag": f'"{m[1]}"'})

    return Handler
