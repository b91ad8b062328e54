"""A GitHub-compatible fake of the pull request API over real HTTP on 127.0.0.1.

Implements, for registered repositories:
- ``GET /repos/{o}/{r}/pulls`` with ``state`` (open|closed|all, default open),
  ``head`` (``owner:branch``), ``per_page`` (capped at ``page_size``), ``page``,
  newest first, and a ``Link`` header (next/prev/first/last) as GitHub sends it;
- ``POST /repos/{o}/{r}/pulls``: 201, or 422 "A pull request already exists for
  o:branch." while one is open for the head (and 422 for a head outside
  ``branches`` when ``check_branches`` is on, and 422 "body is too long" for a body
  over ``max_body`` characters, 65,536 as on GitHub);
- ``PATCH /repos/{o}/{r}/pulls/{n}`` with ``{"state": "closed"}``;
- ``GET`` and ``POST /repos/{o}/{r}/issues/{n}/comments`` (a pull request's comments
  are its issue's; listed oldest first, paginated like the pulls);
- 401 when ``token`` is set and the request's bearer token differs; 404 for an
  unknown repository.

``fail_next(n, status, retry_after, after=k)`` makes ``n`` requests (after the
next ``k``) answer ``status``. Every request is recorded in ``requests`` (method, path, headers).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

MAX_BODY = 65536  # characters: GitHub answers 422 "body is too long" past it


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]


@dataclass
class _Failure:
    status: int
    retry_after: str | None
    headers: dict[str, str] = field(default_factory=dict)


class FakeGitHub:
    def __init__(self, *, token: str | None = None, page_size: int = 2) -> None:
        self.token = token
        self.page_size = page_size
        self.check_branches = False
        self.max_body = MAX_BODY
        self.branches: set[tuple[str, str]] = set()  # (owner/name, branch)
        self.requests: list[Recorded] = []
        self._pulls: dict[str, list[dict[str, Any]]] = {}
        self._comments: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self._failures: list[_Failure | None] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- control -------------------------------------------------------------------------

    def add_repo(self, full_name: str) -> None:
        with self._lock:
            self._pulls.setdefault(full_name, [])

    def fail_next(self, n: int, status: int = 500, *, retry_after: str | None = None,
                  headers: dict[str, str] | None = None, after: int = 0) -> None:
        """Answer ``status`` to ``n`` requests, once ``after`` more have been served."""
        with self._lock:
            self._failures.extend([None] * after)
            self._failures.extend(_Failure(status, retry_after, dict(headers or {}))
                                  for _ in range(n))

    def pulls(self, full_name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(p) for p in self._pulls[full_name]]

    def comments(self, full_name: str, number: int) -> list[str]:
        """The bodies of a pull request's comments, oldest first."""
        with self._lock:
            return [str(c["body"]) for c in self._comments.get((full_name, number), [])]

    def seed(self, full_name: str, *, head: str, base: str = "main", body: str = "",
             state: str = "open", title: str = "seeded") -> int:
        """Add a pull request directly (no HTTP); returns its number."""
        with self._lock:
            return int(self._create(full_name, head, base, title, body, state)["number"])

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeGitHub:
        fake = self

        class Handler(_Handler):
            github = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeGitHub:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- state (call with the lock held) -----------------------------------------------

    def _create(self, full_name: str, head: str, base: str, title: str, body: str,
                state: str = "open") -> dict[str, Any]:
        pulls = self._pulls[full_name]
        number = len(pulls) + 1
        owner = full_name.split("/")[0]
        pr = {"number": number, "state": state, "title": title, "body": body,
              "html_url": f"https://github.com/{full_name}/pull/{number}",
              "url": f"{self.url}/repos/{full_name}/pulls/{number}",
              "head": {"ref": head, "label": f"{owner}:{head}", "sha": "0" * 40},
              "base": {"ref": base, "label": f"{owner}:{base}"},
              "user": {"login": owner}}
        pulls.append(pr)
        return pr


class _Handler(BaseHTTPRequestHandler):
    github: FakeGitHub
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        gh = self.github
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with gh._lock:
            gh.requests.append(Recorded(method, parts.path, query,
                                        {k.lower(): v for k, v in self.headers.items()}))
            failure = gh._failures.pop(0) if gh._failures else None
        if failure is not None:
            headers = dict(failure.headers)
            if failure.retry_after is not None:
                headers["Retry-After"] = failure.retry_after
            self._send(failure.status, {"message": f"injected {failure.status}"}, headers)
            return
        if gh.token is not None and self.headers.get("Authorization") != f"Bearer {gh.token}":
            self._send(401, {"message": "Bad credentials"})
            return
        segs = [s for s in parts.path.split("/") if s]
        if len(segs) < 4 or segs[0] != "repos" or segs[3] not in ("pulls", "issues"):
            self._send(404, {"message": "Not Found"})
            return
        full_name = f"{segs[1]}/{segs[2]}"
        with gh._lock:
            if full_name not in gh._pulls:
                self._send(404, {"message": "Not Found"})
                return
            if segs[3] == "issues":
                if len(segs) == 6 and segs[4].isdigit() and segs[5] == "comments":
                    self._issue_comments(method, full_name, int(segs[4]), parts.path, query,
                                         json.loads(raw or b"{}"))
                else:
                    self._send(404, {"message": "Not Found"})
            elif method == "GET" and len(segs) == 4:
                self._list(full_name, parts.path, query)
            elif method == "POST" and len(segs) == 4:
                self._open(full_name, json.loads(raw or b"{}"))
            elif method == "PATCH" and len(segs) == 5 and segs[4].isdigit():
                self._patch(full_name, int(segs[4]), json.loads(raw or b"{}"))
            else:
                self._send(404, {"message": "Not Found"})

    def _issue_comments(self, method: str, full_name: str, number: int, path: str,
                        query: dict[str, str], data: dict[str, Any]) -> None:
        gh = self.github
        if not any(p["number"] == number for p in gh._pulls[full_name]):
            self._send(404, {"message": "Not Found"})
            return
        comments = gh._comments.setdefault((full_name, number), [])
        if method == "GET":
            self._page(comments, path, query)
        elif method == "POST" and "body" in data:
            comment = {"id": len(comments) + 1, "body": str(data["body"])}
            comments.append(comment)
            self._send(201, comment)
        else:
            self._send(422, {"message": "Validation Failed"})

    def _list(self, full_name: str, path: str, query: dict[str, str]) -> None:
        gh = self.github
        state = query.get("state", "open")
        pulls = list(reversed(gh._pulls[full_name]))  # newest first, as GitHub sorts
        if state != "all":
            pulls = [p for p in pulls if p["state"] == state]
        if "head" in query:
            owner, _, ref = query["head"].partition(":")
            pulls = [p for p in pulls if p["head"]["label"] == f"{owner}:{ref}"]
        self._page(pulls, path, query)

    def _page(self, items: list[dict[str, Any]], path: str, query: dict[str, str]) -> None:
        gh = self.github
        per_page = min(int(query.get("per_page", 30)), gh.page_size)
        page = int(query.get("page", 1))
        last = max(1, -(-len(items) // per_page))
        chunk = items[(page - 1) * per_page: page * per_page]
        host = self.headers.get("Host", "127.0.0.1")

        def link(p: int) -> str:
            q = {**query, "per_page": str(per_page), "page": str(p)}
            return f"<http://{host}{path}?{urlencode(q)}>"

        rels = []
        if page < last:
            rels += [f'{link(page + 1)}; rel="next"', f'{link(last)}; rel="last"']
        if page > 1:
            rels += [f'{link(1)}; rel="first"', f'{link(page - 1)}; rel="prev"']
        self._send(200, chunk, {"Link": ", ".join(rels)} if rels else None)

    def _open(self, full_name: str, data: dict[str, Any]) -> None:
        gh = self.github
        head, base = str(data.get("head", "")), str(data.get("base", ""))
        owner = full_name.split("/")[0]
        if not head or not base or "title" not in data:
            self._send(422, {"message": "Validation Failed",
                             "errors": [{"resource": "PullRequest", "code": "missing_field"}]})
            return
        if len(str(data.get("body") or "")) > gh.max_body:  # as GitHub refuses it
            self._send(422, {"message": "Validation Failed", "errors": [{
                "resource": "PullRequest", "code": "custom", "field": "body",
                "message": f"body is too long (maximum is {gh.max_body} characters)"}]})
            return
        if gh.check_branches and (full_name, head) not in gh.branches:
            self._send(422, {"message": "Validation Failed",
                             "errors": [{"resource": "PullRequest", "field": "head",
                                         "code": "invalid"}]})
            return
        if any(p["head"]["ref"] == head and p["state"] == "open" for p in gh._pulls[full_name]):
            self._send(422, {"message": "Validation Failed",
                             "errors": [{"resource": "PullRequest", "code": "custom",
                                         "message": "A pull request already exists for "
                                                    f"{owner}:{head}."}]})
            return
        pr = gh._create(full_name, head, base, str(data["title"]), str(data.get("body") or ""))
        self._send(201, pr)

    def _patch(self, full_name: str, number: int, data: dict[str, Any]) -> None:
        for pr in self.github._pulls[full_name]:
            if pr["number"] == number:
                if "state" in data:
                    pr["state"] = data["state"]
                self._send(200, pr)
                return
        self._send(404, {"message": "Not Found"})
