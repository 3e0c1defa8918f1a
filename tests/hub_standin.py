"""A local stand-in for the Hugging Face Hub's HTTP endpoints that `mla_convert.hub.push` reaches through
huggingface_hub (read from huggingface_hub 2.4's hf_api.py, _commit_api.py, _upload_pipeline.py and lfs.py).

Loopback only (127.0.0.1, a free port), bounded (request bodies over `max_body` bytes get 413, a socket timeout per
request), state in memory. Implemented, and nothing else (anything else answers 404 and is recorded):

    POST /api/repos/create                          create_repo (409 if it exists, 403 outside `namespaces`)
    GET  /api/models/{repo}[/revision/{rev}]        repo_info / model_info
    GET  /api/models/{repo}/tree/{rev}              list_repo_tree / list_repo_files (one page, recursive)
    POST /api/models/{repo}/branch/{branch}         create_branch (409 if it exists)
    POST /api/validate-yaml                         README.md front-matter check before an upload
    POST /api/models/{repo}/preupload/{rev}         upload mode per file: "regular", or "lfs" from `lfs_min_size`
    POST /api/models/{repo}/commit/{rev}            the ndjson commit: header, file (base64), lfsFile, deleted*
    POST /{repo}.git/info/lfs/objects/batch         LFS batch API, "basic" transfer (PUT then verify)
    PUT  /lfs-upload/{oid}                          basic-transfer upload target (sha256 checked)
    POST /lfs-verify/{oid}                          basic-transfer verify action

Upload modes. With `hf_xet` installed (the default), `upload_folder` runs huggingface_hub's pipelined uploader, which
sends every non-"regular" file through Xet storage; the Xet CAS protocol is not stood in, so with the default
`lfs_min_size=None` every file is "regular" (base64 inside the commit), which exercises the real production code path
(preupload, batching, commit). To exercise large-file transfer, set `lfs_min_size` and disable Xet in the client
(`huggingface_hub.constants.HF_HUB_DISABLE_XET = True`): files of at least that size then go through the LFS batch API
and a basic-transfer PUT, as on the Hub without hf_xet.

Every request needs `Authorization: Bearer <token>` with the stand-in's token (401 otherwise). The token may create
repos and write (branch, preupload, commit, LFS batch) only in `namespaces` (403 otherwise); `add_repo` can seed a repo
anywhere, e.g. someone else's that the token can read but not write. `fail(route, status)`
makes the next request to a route fail, to test error handling and resuming.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data), "oid": git_blob_oid(self.data)}
        if self.lfs:
            entry["lfs"] = {"oid": hashlib.sha256(self.data).hexdigest(), "size": len(self.data), "pointerSize": 134}
        return entry

    def remote_oid(self) -> str:
        # What preupload reports and huggingface_hub compares with its local oid to skip unchanged files.
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_oid(self.data)


@dataclass
class Commit:
    oid: str
    branch: str
    summary: str
    description: str
    parent: str | None
    added: list[str]
    deleted: list[str]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, dict[str, StoredFile]] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)

    def files(self, branch: str = "main") -> dict[str, bytes]:
        return {path: f.data for path, f in self.branches[branch].items()}


GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


class HubStandIn:
    """`with HubStandIn(token=...) as hub:` serves on `hub.url` until the block ends."""

    def __init__(self, token: str = "hf_standin_token", namespaces=("tester", "test-org"), lfs_min_size=None,
                 max_body: int = 64 * 2**20):
        self.token = token
        self.namespaces = set(namespaces)
        self.lfs_min_size = lfs_min_size
        self.max_body = max_body
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._failures: dict[str, list[int]] = {}
        self._lock = threading.RLock()  # re-entrant: routes run under it and `_send` records under it too
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- control ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail(self, route: str, status: int, times: int = 1) -> None:
        """Answer the next `times` requests to `route` (a name like "commit", "lfs-upload") with `status`."""
        self._failures.setdefault(route, []).extend([status] * times)

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, private: bool = False) -> Repo:
        repo = self._create(repo_id, private)
        if files:
            self._commit(repo, "main", "seed", "", None, {p: StoredFile(d, False) for p, d in files.items()}, [])
        return repo

    def count(self, method: str, prefix: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and p.startswith(prefix))

    def __enter__(self) -> "HubStandIn":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- state --------------------------------------------------------------------------------------------------

    def _create(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id=repo_id, private=private)
        self.repos[repo_id] = repo
        # Like the Hub: a new repo starts with one commit holding .gitattributes.
        self._commit(repo, "main", "initial commit", "", None, {".gitattributes": StoredFile(GITATTRIBUTES, False)},
                     [])
        return repo

    def _commit(self, repo, branch, summary, description, parent, added: dict[str, StoredFile], deleted) -> Commit:
        files = repo.branches.setdefault(branch, {})
        for path in deleted:
            files.pop(path, None)
        files.update(added)
        digest = hashlib.sha1(json.dumps([repo.heads.get(branch), summary, sorted(added), sorted(deleted),
                                          len(repo.commits)]).encode())
        commit = Commit(digest.hexdigest(), branch, summary, description, parent, sorted(added), sorted(deleted))
        repo.commits.append(commit)
        repo.heads[branch] = commit.oid
        return commit


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn
    timeout = 30  # seconds per socket read: a stuck client cannot hold a thread forever
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing -----------------------------------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                if len(out) + size > self.hub.max_body:
                    raise _TooLarge()
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.hub.max_body:
            raise _TooLarge()
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload=None, headers: dict | None = None) -> None:
        data = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        path = urlsplit(self.path).path
        with self.hub._lock:
            self.hub.requests.append((self.command, path, status))

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            body = self._body()
        except _TooLarge:
            self.close_connection = True
            return self._error(413, "request body too large for the stand-in")
        path = urlsplit(self.path).path
        query = parse_qs(urlsplit(self.path).query)
        for method, pattern, route in _ROUTES:
            match = re.fullmatch(pattern, path)
            if method == self.command and match:
                break
        else:
            return self._error(404, f"stand-in has no route for {self.command} {path}")
        if self.headers.get("Authorization") != f"Bearer {self.hub.token}" and route != "lfs-upload":
            return self._error(401, "Invalid credentials in Authorization header")
        repo_id = unquote(match.groupdict().get("repo") or "")
        if route in _WRITE_ROUTES and repo_id.split("/")[0] not in self.hub.namespaces:
            # like the Hub: the token may read a public repo of someone else but not write to it
            return self._error(403, f'You don\'t have the rights to write to "{repo_id}"')
        pending = self.hub._failures.get(route)
        if pending:
            return self._error(pending.pop(0), f"injected failure of {route}")
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        with self.hub._lock:
            getattr(self, "route_" + route.replace("-", "_"))(body=body, query=query, **args)

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
        return repo

    def _branch(self, repo: Repo, rev: str) -> dict | None:
        files = repo.branches.get(rev)
        if files is None:
            self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return files

    # -- routes -------------------------------------------------------------------------------------------------

    def route_create(self, body, query) -> None:
        payload = json.loads(body)
        namespace = payload.get("organization") or "tester"
        repo_id = f"{namespace}/{payload['name']}"
        if namespace not in self.hub.namespaces:
            return self._error(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        if repo_id in self.hub.repos:
            return self._send(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
        self.hub._create(repo_id, payload.get("visibility") == "private" or payload.get("private") is True)
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def route_info(self, body, query, repo, rev="main") -> None:
        repo_obj = self._repo(repo)
        if repo_obj is None or (files := self._branch(repo_obj, rev)) is None:
            return
        self._send(200, {"id": repo, "sha": repo_obj.heads[rev], "private": repo_obj.private,
                         "siblings": [{"rfilename": p} for p in sorted(files)]})

    def route_tree(self, body, query, repo, rev, path="") -> None:
        repo_obj = self._repo(repo)
        if repo_obj is None or (files := self._branch(repo_obj, rev)) is None:
            return
        prefix = path.strip("/") + "/" if path else ""
        self._send(200, [f.tree_entry(p) for p, f in sorted(files.items()) if p.startswith(prefix)])

    def route_branch(self, body, query, repo, branch) -> None:
        repo_obj = self._repo(repo)
        if repo_obj is None:
            return
        if branch in repo_obj.branches:
            return self._error(409, "Reference already exists")
        start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
        repo_obj.branches[branch] = dict(repo_obj.branches[start])
        repo_obj.heads[branch] = repo_obj.heads[start]
        self._send(200, {})

    def route_validate_yaml(self, body, query) -> None:
        content = json.loads(body)["content"]
        match = re.match(r"^\s*---\r?\n(.*?)\r?\n---", content, re.S)
        try:
            data = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as e:
            return self._send(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
        if data is not None and not isinstance(data, dict):
            return self._send(400, {"errors": [{"message": "metadata must be a mapping"}]})
        self._send(200, {"warnings": []})

    def route_preupload(self, body, query, repo, rev) -> None:
        repo_obj = self._repo(repo)
        if repo_obj is None or (files := self._branch(repo_obj, rev)) is None:
            return
        out = []
        for item in json.loads(body)["files"]:
            lfs = self.hub.lfs_min_size is not None and item["size"] >= self.hub.lfs_min_size
            existing = files.get(item["path"])
            oid = existing.remote_oid() if existing is not None and existing.lfs == lfs else None
            out.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self._send(200, {"files": out, "commitOid": repo_obj.heads[rev]})

    def route_commit(self, body, query, repo, rev) -> None:
        repo_obj = self._repo(repo)
        if repo_obj is None or self._branch(repo_obj, rev) is None:
            return
        header, added, deleted = {}, {}, []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                added[value["path"]] = StoredFile(base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                data = self.hub.lfs_objects.get(value["oid"])
                if data is None:
                    return self._error(422, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                added[value["path"]] = StoredFile(data, True)
            elif key == "deletedFile":
                deleted.append(value["path"])
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                deleted += [p for p in repo_obj.branches[rev] if p.startswith(prefix)]
            else:
                return self._error(400, f"unknown commit operation {key}")
        if not header.get("summary"):
            return self._error(400, "commit summary is required")
        parent = header.get("parentCommit")
        if parent and not repo_obj.heads[rev].startswith(parent):
            return self._error(412, "A commit has happened since the parent commit")
        commit = self.hub._commit(repo_obj, rev, header["summary"], header.get("description", ""), parent, added,
                                  deleted)
        self._send(200, {"success": True, "commitOid": commit.oid,
                         "commitUrl": f"{self.hub.url}/{repo}/commit/{commit.oid}"})

    def route_lfs_batch(self, body, query, repo) -> None:
        if self._repo(repo) is None:
            return
        payload = json.loads(body)
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.hub.lfs_objects:  # already stored: no actions, the client skips it
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/lfs-upload/{obj['oid']}"},
                                    "verify": {"href": f"{self.hub.url}/lfs-verify/{obj['oid']}"}}
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects})

    def route_lfs_upload(self, body, query, oid) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return self._error(400, "content does not match its sha256 oid")
        self.hub.lfs_objects[oid] = body
        self._send(200, {})

    def route_lfs_verify(self, body, query, oid) -> None:
        if oid not in self.hub.lfs_objects:
            return self._error(404, "object not found")
        self._send(200, {})


class _TooLarge(Exception):
    pass


_WRITE_ROUTES = {"branch", "preupload", "commit", "lfs-batch"}
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_ROUTES = [
    ("POST", r"/api/repos/create", "create"),
    ("GET", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", "tree"),
    ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?", "info"),
    ("POST", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)", "branch"),
    ("POST", r"/api/validate-yaml", "validate-yaml"),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs-batch"),
    ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs-upload"),
    ("POST", r"/lfs-verify/(?P<oid>[0-9a-f]{64})", "lfs-verify"),
]
