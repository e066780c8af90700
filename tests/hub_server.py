"""A local HTTP server standing in for the Hugging Face Hub (`HF_ENDPOINT=hub.url`), with the
part of the Hub's HTTP API that huggingface_hub's `resolve_revision`, `snapshot_download` and
`hf_hub_download` use (read from huggingface_hub 2.4):

  GET  /api/models/{repo}[/revision/{rev}] {"id", "sha", "siblings": [{"rfilename"}]}
  GET  /api/models/{repo}/tree/{rev}       [{"type": "file", "path", "size", "oid", "lfs"?}]
  HEAD /{repo}/resolve/{rev}/{file}        X-Repo-Commit, ETag (LFS files: X-Linked-Etag and
                                           X-Linked-Size, their sha256 and size), Content-Length
  GET  /{repo}/resolve/{rev}/{file}        the bytes; `Range: bytes=N-` answers 206

Errors as the Hub sends them (huggingface_hub maps them by X-Error-Code): a missing or
private repo without a token is 401 RepoNotFound, a missing revision 404 RevisionNotFound, a
missing file 404 EntryNotFound, a gated repo's files without a token 401 GatedRepo.

    with FakeHub() as hub:
        sha = hub.add_repo("org/tiny", folder)            # branch main -> a new commit
        hub.add_repo("org/tiny", other, branch="v1")       # another commit on branch v1
        hub.drop_once["model.safetensors"] = 1000          # cut the next GET after 1000 bytes
        hub.requests                                       # [(method, path, range header)]

Tests point huggingface_hub at it with `hub_env` (huggingface_hub reads HF_ENDPOINT and
HF_HUB_OFFLINE when it is imported, so the fixture sets its constants too).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

TOKEN = "hf_fake_token_for_tests"
LFS_SUFFIXES = (".safetensors", ".bin", ".model")
_API = re.compile(r"^/api/models/(.+?)(?:/(revision|tree)/([^/]+)(?:/.*)?)?$")
_RESOLVE = re.compile(r"^/(.+?)/resolve/([^/]+)/(.+)$")


def folder_files(folder: str) -> dict[str, bytes]:
    """Every file under `folder` as {relative path with '/': bytes}."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            with open(path, "rb") as f:
                files[rel] = f.read()
    return files


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.drop_once: dict[str, int] = {}
        """file name -> bytes sent before the next GET of it is cut (then served normally)."""
        self.drop_always: dict[str, int] = {}
        """file name -> bytes sent before every GET of it is cut (until removed)."""
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- content ---------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: str | dict[str, bytes], *, branch: str = "main",
                 gated: bool = False, private: bool = False) -> str:
        """Commit `files` (a folder or {path: bytes}) on `branch` of `repo_id` (made if new);
        returns the commit sha."""
        if isinstance(files, str):
            files = folder_files(files)
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        repo["gated"], repo["private"] = gated, private
        digest = hashlib.sha1(repr(sorted((k, _git_blob_sha(v)) for k, v in files.items()))
                              .encode() + repo_id.encode() + branch.encode())
        sha = digest.hexdigest()
        repo["commits"][sha] = dict(files)
        repo["refs"][branch] = sha
        return sha

    def file_gets(self, name: str | None = None) -> list[str]:
        """Paths of the GET requests for files (optionally of one file name)."""
        return [path for method, path, _ in self.requests if method == "GET" and "/resolve/" in
                path and (name is None or path.endswith("/" + name))]

    # ---- server ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, "HEAD")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- requests --------------------------------------------------------------------------
    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(req.path).path
        with self._lock:
            self.requests.append((method, path, req.headers.get("Range")))
        authorized = req.headers.get("Authorization") == f"Bearer {TOKEN}"
        api, resolve = _API.match(path), _RESOLVE.match(path)
        match = api or resolve
        if match is None:
            return self._error(req, 404, "", "Not found")
        repo_id = unquote(match.group(1))
        repo = self.repos.get(repo_id)
        if repo is None or (repo["private"] and not authorized):
            return self._error(req, 401, "RepoNotFound", "Repository not found")
        if api:  # (no revision: the default branch)
            kind, rev = api.group(2) or "revision", unquote(api.group(3) or "main")
        else:
            kind, rev = "resolve", unquote(resolve.group(2))
        sha = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
        if sha is None:
            return self._error(req, 404, "RevisionNotFound", "Invalid rev id: " + rev)
        files = repo["commits"][sha]
        if kind == "revision":
            return self._json(req, {"id": repo_id, "sha": sha, "private": repo["private"],
                                    "gated": "manual" if repo["gated"] else False,
                                    "siblings": [{"rfilename": f} for f in sorted(files)]})
        if kind == "tree":
            return self._json(req, [self._tree_entry(name, data)
                                    for name, data in sorted(files.items())])
        if repo["gated"] and not authorized:
            return self._error(req, 401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        name = unquote(resolve.group(3))
        if name not in files:
            return self._error(req, 404, "EntryNotFound", f"{name} does not exist", sha)
        self._send_file(req, method, name, files[name], sha)

    @staticmethod
    def _tree_entry(name: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                                 "oid": _git_blob_sha(data)}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    def _send_file(self, req: BaseHTTPRequestHandler, method: str, name: str, data: bytes,
                   sha: str) -> None:
        start = 0
        wanted = req.headers.get("Range")
        if wanted and method == "GET":
            found = re.match(r"bytes=(\d+)-$", wanted)
            start = int(found.group(1)) if found else 0
        body = data[start:]
        req.send_response(206 if start else 200)
        req.send_header("X-Repo-Commit", sha)
        if name.endswith(LFS_SUFFIXES):
            req.send_header("ETag", f'"{_git_blob_sha(data)}"')
            req.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            req.send_header("X-Linked-Size", str(len(data)))
        else:
            req.send_header("ETag", f'"{_git_blob_sha(data)}"')
        if start:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.send_header("Content-Length", str(len(body)))
        req.send_header("Accept-Ranges", "bytes")
        req.end_headers()
        if method == "HEAD":
            return
        base = name.rsplit("/", 1)[-1]
        with self._lock:
            cut = self.drop_once.pop(base, None)
            if cut is None:
                cut = self.drop_always.get(base)
        if cut is not None and cut < len(body):
            req.wfile.write(body[:cut])
            req.wfile.flush()
            req.close_connection = True
            try:
                req.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        req.wfile.write(body)

    @staticmethod
    def _json(req: BaseHTTPRequestHandler, data: Any) -> None:
        body = json.dumps(data).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    @staticmethod
    def _error(req: BaseHTTPRequestHandler, status: int, code: str, message: str,
               sha: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        if sha:
            req.send_header("X-Repo-Commit", sha)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)


def hub_env(monkeypatch: Any, endpoint: str | None, cache_dir: str | None = None,
            offline: bool = False, token: str | None = None) -> None:
    """Point huggingface_hub (already imported or not) at `endpoint` and `cache_dir`, set
    HF_HUB_OFFLINE and HF_TOKEN, for the rest of the test."""
    from huggingface_hub import constants

    if endpoint is not None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    if cache_dir is not None:
        monkeypatch.setenv("HF_HUB_CACHE", cache_dir)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    # no token file of this machine (`hf auth login`)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", os.path.join(os.sep, "nonexistent", "token"))


def subprocess_env(endpoint: str, cache_dir: str, offline: bool = False) -> dict[str, str]:
    """os.environ for a child process that talks to the fake Hub."""
    env = dict(os.environ)
    env.update({"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": cache_dir,
                "HF_HUB_OFFLINE": "1" if offline else "0", "TRANSFORMERS_OFFLINE": "",
                "HF_TOKEN_PATH": os.path.join(cache_dir, "no-token")})
    env.pop("HF_TOKEN", None)
    env.pop("HUGGING_FACE_HUB_TOKEN", None)
    return env


def write_cache_by_hand(cache_dir: str, repo_id: str, folder: str, commit: str,
                        branch: str = "main") -> str:
    """Lay `folder` out in `cache_dir` as huggingface_hub's cache does, without it (and without
    the commit's file-list cache `trees/`, as older huggingface_hub versions wrote it):
    models--ORG--NAME/blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag> (relative
    symlinks), refs/<branch> holding the commit. Returns the snapshot folder."""
    storage = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    for name, data in folder_files(folder).items():
        etag = (hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES)
                else _git_blob_sha(data))
        blob = os.path.join(storage, "blobs", etag)
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, *name.split("/"))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", branch), "w") as f:
        f.write(commit)
    return snapshot
