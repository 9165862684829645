"""Hugging Face Hub stand-ins for download/models/doctor tests (no network).

* ``build_cached_repo`` writes the layout huggingface_hub keeps on disk (its documented cache layout):
  ``models--org--name/{refs/main, blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>}``.
* ``FakeHub`` is a tiny HTTP server on 127.0.0.1 that answers the few endpoints ``snapshot_download``
  calls (repo info, tree listing, HEAD/GET ``resolve``) and honours ``Range`` requests. It can cut a
  file's body short once, the way a dropped connection does, so resuming is exercised for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

FIXTURE = Path(__file__).parent / "fixtures" / "zlab-tiny-b8"
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of a folder (recursively) as ``{relative path: bytes}``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fixture_files(which: str) -> dict[str, bytes]:
    """Files of the reference fixture's ``target`` or ``drafter`` folder."""
    return folder_files(FIXTURE / which)


def commit_for(repo_id: str, salt: str = "") -> str:
    """A stable 40-hex commit id for a repo."""
    return hashlib.sha1(f"{repo_id}{salt}".encode()).hexdigest()


def git_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the Hub reports as ``oid`` of small files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_cached_repo(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes],
    commit: str | None = None,
    ref: str = "main",
    copy: bool = False,
) -> Path:
    """Write ``files`` as a cached snapshot of ``repo_id``; return the snapshot folder.

    Args:
        cache: the hub cache root (``HF_HUB_CACHE``).
        files: file name -> content.
        commit: snapshot commit (default: derived from the repo id).
        ref: the ref file to write (``refs/<ref>``).
        copy: write plain copies instead of relative symlinks (both are accepted by huggingface_hub).
    """
    commit = commit or commit_for(repo_id)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / sha
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if copy:
            link.write_bytes(data)
        else:
            os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


@dataclass
class FakeRepo:
    """One repo served by ``FakeHub``."""

    files: dict[str, bytes]
    commit: str
    gated: bool = False


@dataclass
class FakeHub:
    """A Hub-compatible HTTP endpoint on 127.0.0.1 (see the module docstring).

    Attributes:
        repos: repo id -> ``FakeRepo``.
        cut_once: ``org/name/file`` -> bytes to send before dropping the connection, on the first GET only.
        fail: ``org/name/file`` whose GET answers 500 (to stop a download half way).
        requests: log of ``(method, path, Range header or None)``.
    """

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)
    fail: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> FakeRepo:
        repo = FakeRepo(dict(files), commit_for(repo_id, "hub"), gated)
        self.repos[repo_id] = repo
        return repo

    def gets(self, repo_id: str, filename: str) -> list[str | None]:
        """Range headers of every GET of a file (None: a request for the whole file)."""
        head = f"/{repo_id}/resolve/"
        return [
            rng
            for m, p, rng in self.requests
            if m == "GET" and p.startswith(head) and unquote(p).split("/", 5)[-1] == filename
        ]

    def fetched(self, suffix: str) -> list[str]:
        """Paths of every GET of a file whose name ends with ``suffix``."""
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)]

    @contextmanager
    def serve(self) -> Iterator[FakeHub]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def _json(self, data: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _not_found(self, code: str) -> None:
                self._json({"error": code}, 404, {"X-Error-Code": code, "X-Error-Message": code})

            def _route(self) -> tuple[str, FakeRepo | None, str]:
                path = unquote(urlparse(self.path).path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id = "/".join(parts[2:4])
                    return "api:" + "/".join(parts[4:]), hub.repos.get(repo_id), repo_id
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id = "/".join(parts[:2])
                    return "resolve:" + "/".join(parts[4:]), hub.repos.get(repo_id), repo_id
                return "other", None, ""

            def _handle(self, head: bool) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                kind, repo, repo_id = self._route()
                if repo is None:
                    self._not_found("RepoNotFound")
                    return
                if repo.gated and not self.headers.get("Authorization"):
                    self._json({"error": "gated"}, 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"})
                    return
                if kind.startswith("api:revision") or kind == "api:":
                    siblings = [{"rfilename": n} for n in repo.files]
                    self._json({"id": "x", "sha": repo.commit, "siblings": siblings, "private": False})
                elif kind.startswith("api:tree"):
                    self._json([self._tree_entry(n, d) for n, d in repo.files.items()])
                elif kind.startswith("resolve:"):
                    self._file(repo, repo_id, kind.removeprefix("resolve:"), head)
                else:
                    self._not_found("EntryNotFound")

            @staticmethod
            def _tree_entry(name: str, data: bytes) -> dict[str, object]:
                entry: dict[str, object] = {"type": "file", "path": name, "size": len(data), "oid": git_sha1(data)}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return entry

            def _file(self, repo: FakeRepo, repo_id: str, name: str, head: bool) -> None:
                data = repo.files.get(name)
                if data is None:
                    self._json({"error": "entry"}, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
                    return
                lfs = name.endswith(LFS_SUFFIXES)
                etag = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and not head:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                if not head and f"{repo_id}/{name}" in hub.fail:
                    self._json({"error": "server"}, 500)
                    return
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("ETag", f'"{etag}"')
                if lfs:
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if head:
                    return
                cut = hub.cut_once.pop(f"{repo_id}/{name}", None)
                if cut is not None:
                    # promise the whole body, send part of it, drop the connection
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                self._handle(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._handle(head=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
