"""GitHub (and GitHub-compatible) pull requests over the REST API, with httpx.

Errors are classified for the retry policy, never retried here:
- 5xx, 408, 429, rate-limit 403s and network failures: ``CodeHostError(transient=True)``,
  with ``retry_after`` (seconds) when the server said how long to wait;
- 422 "A pull request already exists": ``PullRequestExists``;
- 422 on creating a pull request whose ``head`` is ``invalid`` (GitHub does not see a
  branch pushed a moment ago yet): ``CodeHostError(transient=True)``;
- 401, 403 (not rate limiting), 404, other 4xx: ``CodeHostError(transient=False)``.
"""

from __future__ import annotations

import email.utils
import importlib.metadata
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from runlane.codehost.base import CodeHostError, PullRequest, PullRequestExists

# Re-exported: the names were defined here before github_names held them.
from runlane.codehost.github_names import DEFAULT_API_URL as DEFAULT_API_URL
from runlane.codehost.github_names import github_host as github_host
from runlane.codehost.github_names import parse_github_repo as parse_github_repo

API_VERSION = "2022-11-28"
PAGE_SIZE = 100
MAX_PAGES = 100  # 10,000 pull requests for one head is far beyond any real case


def _user_agent() -> str:
    try:
        return f"runlane/{importlib.metadata.version('runlane')}"
    except importlib.metadata.PackageNotFoundError:
        return "runlane"


def _retry_after(headers: httpx.Headers, now: float) -> float | None:
    """Seconds to wait from ``Retry-After`` (seconds or an HTTP date), else from
    ``X-RateLimit-Reset`` when the limit is spent; None when neither says."""
    value = headers.get("retry-after")
    if value:
        value = value.strip()
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                when = None
            if when is not None:
                return max(0.0, when.timestamp() - now)
    if headers.get("x-ratelimit-remaining") == "0":
        reset = headers.get("x-ratelimit-reset")
        try:
            return max(0.0, float(reset) - now) if reset else None
        except ValueError:
            return None
    return None


def _message(resp: httpx.Response) -> str:
    """GitHub's ``message`` plus every ``errors[].message``, or the raw text."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    if not isinstance(data, dict):
        return str(data)[:300]
    parts = [str(data.get("message", ""))]
    for err in data.get("errors") or []:
        if isinstance(err, dict):
            parts.append(str(err.get("message") or err.get("code") or ""))
        else:
            parts.append(str(err))
    return "; ".join(p for p in parts if p)


def _names_invalid_head(resp: httpx.Response) -> bool:
    """A 422 whose ``errors`` say the pull request's ``head`` is ``invalid``: the branch
    is not (yet) known to GitHub."""
    try:
        data = resp.json()
    except ValueError:
        return False
    errors = data.get("errors") if isinstance(data, dict) else None
    return any(isinstance(err, dict) and err.get("field") == "head"
               and err.get("code") == "invalid" for err in errors or [])


class GitHubClient:
    """A ``CodeHost`` for GitHub's REST API (or anything that speaks it)."""

    def __init__(self, base_url: str = DEFAULT_API_URL, token: str | None = None,
                 timeout: float = 10.0, *, transport: httpx.BaseTransport | None = None,
                 user_agent: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._deadline: float | None = None  # set_deadline: a time.monotonic() value
        base = urlsplit(self.base_url)
        self._origin = (base.scheme, base.netloc)
        headers = {"Accept": "application/vnd.github+json",
                   "X-GitHub-Api-Version": API_VERSION,
                   "User-Agent": user_agent or _user_agent()}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  timeout=httpx.Timeout(timeout), follow_redirects=True,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GitHubClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the CodeHost interface -------------------------------------------------

    def find_pull_request(self, repo: str, head_branch: str, marker: str) -> PullRequest | None:
        """The pull request (open or closed) from ``head_branch`` whose body carries
        ``marker``: the open one if any, else the newest; None when none."""
        owner, name = parse_github_repo(repo)
        matches = [pr for pr in self._pulls(owner, name, head=f"{owner}:{head_branch}")
                   if pr.head_branch == head_branch and marker in pr.body]
        if not matches:
            return None
        return max(matches, key=lambda pr: (pr.state == "open", pr.number))

    def open_pull_request(self, repo: str, *, head_branch: str, base_branch: str, title: str,
                          body: str) -> PullRequest:
        owner, name = parse_github_repo(repo)
        resp = self._request("POST", f"{self._repo_path(owner, name)}/pulls",
                             json={"title": title, "head": head_branch, "base": base_branch,
                                   "body": body})
        return self._to_pr(owner, name, self._json(resp))

    def list_pull_requests(self, repo: str) -> list[PullRequest]:
        """Every pull request of the repository, open and closed, by number."""
        owner, name = parse_github_repo(repo)
        return sorted(self._pulls(owner, name, head=None), key=lambda pr: pr.number)

    # -- beyond the interface ------------------------------------------------------

    def close_pull_request(self, repo: str, number: int) -> PullRequest:
        owner, name = parse_github_repo(repo)
        resp = self._request("PATCH", f"{self._repo_path(owner, name)}/pulls/{int(number)}",
                             json={"state": "closed"})
        return self._to_pr(owner, name, self._json(resp))

    def comment_on_pull_request(self, repo: str, number: int, body: str, *,
                                marker: str) -> bool:
        """A pull request's comments are its issue's (``/issues/{n}/comments``): posted
        unless one carrying ``marker`` is there already."""
        owner, name = parse_github_repo(repo)
        path = f"{self._repo_path(owner, name)}/issues/{int(number)}/comments"
        for item in self._items(path, {"per_page": PAGE_SIZE}):
            if isinstance(item, dict) and marker in str(item.get("body") or ""):
                return False
        self._request("POST", path, json={"body": body})
        return True

    def set_deadline(self, deadline: float | None) -> None:
        """No request made after this may last past ``deadline`` (``time.monotonic()``),
        whatever the client's timeout; None lifts it. A request begun after it fails at
        once, as a transient error."""
        self._deadline = deadline

    # -- plumbing ----------------------------------------------------------------------

    @staticmethod
    def _repo_path(owner: str, name: str) -> str:
        return f"/repos/{quote(owner, safe='')}/{quote(name, safe='')}"

    def _pulls(self, owner: str, name: str, *, head: str | None) -> Iterator[PullRequest]:
        params: dict[str, str | int] = {"state": "all", "per_page": PAGE_SIZE}
        if head is not None:
            params["head"] = head
        for item in self._items(f"{self._repo_path(owner, name)}/pulls", params):
            yield self._to_pr(owner, name, item)

    def _items(self, path: str, params: dict[str, str | int]) -> Iterator[Any]:
        """Every item of a paginated list, following the ``Link`` header."""
        resp = self._request("GET", path, params=params)
        seen: set[str] = set()
        for _ in range(MAX_PAGES):
            page = self._json(resp)
            if not isinstance(page, list):
                raise CodeHostError(f"unexpected list from {resp.url}",
                                    transient=True, status=resp.status_code)
            yield from page
            next_url = resp.links.get("next", {}).get("url")
            if not next_url or next_url in seen:
                return
            seen.add(next_url)
            target = urlsplit(next_url)
            if target.netloc and (target.scheme, target.netloc) != self._origin:
                # never send the token to a host other than the API's
                raise CodeHostError(f"pagination link leaves {self.base_url}: {next_url}",
                                    transient=False)
            resp = self._request("GET", next_url)
        raise CodeHostError(f"more than {MAX_PAGES} pages of {path}", transient=False)

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise CodeHostError(f"GitHub {method} {url}: no time left before the "
                                    "deadline (the lease's window)", transient=True)
            kwargs["timeout"] = httpx.Timeout(min(self.timeout, left))
        try:
            resp = self._http.request(method, url, **kwargs)
        except httpx.UnsupportedProtocol as exc:
            raise CodeHostError(f"GitHub API URL unusable: {exc}", transient=False) from exc
        except httpx.RequestError as exc:  # connect/read/write/timeouts/protocol errors
            raise CodeHostError(f"GitHub unreachable ({type(exc).__name__}): {exc}",
                                transient=True) from exc
        if resp.is_success:
            return resp
        raise self._classify(method, resp)

    @staticmethod
    def _classify(method: str, resp: httpx.Response) -> Exception:
        status = resp.status_code
        msg = _message(resp)
        what = f"GitHub {method} {resp.url.path} -> {status}: {msg}"
        wait = _retry_after(resp.headers, time.time())
        if status == 422 and "pull request already exists" in msg.lower():
            return PullRequestExists(what)
        if status == 422 and method == "POST" and resp.url.path.endswith("/pulls") \
                and _names_invalid_head(resp):
            # Right after a push GitHub may not see the new branch yet: a retry (which
            # resumes from the pushed branch) opens it. Bounded by the attempt budget.
            return CodeHostError(what, transient=True, retry_after=wait, status=status)
        if status == 429 or status == 408 or status >= 500:
            return CodeHostError(what, transient=True, retry_after=wait, status=status)
        if status == 403 and (wait is not None or "rate limit" in msg.lower()):
            return CodeHostError(what, transient=True, retry_after=wait, status=status)
        return CodeHostError(what, transient=False, status=status)

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError as exc:
            raise CodeHostError(f"GitHub answered {resp.status_code} without JSON: "
                                f"{resp.text[:200]!r}", transient=True,
                                status=resp.status_code) from exc

    @staticmethod
    def _to_pr(owner: str, name: str, item: Any) -> PullRequest:
        try:
            return PullRequest(
                repo=f"{owner}/{name}", number=int(item["number"]),
                url=str(item.get("html_url") or item.get("url") or ""),
                head_branch=str(item["head"]["ref"]), base_branch=str(item["base"]["ref"]),
                title=str(item.get("title") or ""), body=str(item.get("body") or ""),
                state=str(item.get("state") or "open"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CodeHostError(f"unexpected pull request object: {exc!r}",
                                transient=True) from exc
