"""Code hosts: LocalForge on real bare git repositories (and real processes racing
on its storage), GitHubClient against a GitHub-compatible fake over real HTTP on
127.0.0.1, and the factory that picks one."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runlane.codehost import (
    CodeHostError,
    GitHubClient,
    LocalForge,
    PullRequest,
    PullRequestExists,
    code_host_for,
    normalize_repo,
    parse_github_repo,
    pr_marker,
)
from runlane.codehost.factory import clone_source

from .fake_github import FakeGitHub
from .support import wait_until

GIT_ENV = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_TERMINAL_PROMPT": "0"}


def git(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True,
                          capture_output=True, text=True).stdout


def make_remote(tmp_path: Path, name: str, branches: list[str]) -> Path:
    """A real bare repository with ``main`` and ``branches`` pushed from a clone."""
    bare = tmp_path / f"{name}.git"
    git("init", "--bare", "-q", "-b", "main", str(bare))
    work = tmp_path / f"{name}-work"
    git("clone", "-q", str(bare), str(work))
    git("checkout", "-q", "-b", "main", cwd=work)
    (work / "README").write_text("hello\n")
    git("add", "README", cwd=work)
    git("commit", "-q", "-m", "init", cwd=work)
    for branch in branches:
        git("branch", branch, cwd=work)
    git("push", "-q", "origin", "main", *branches, cwd=work)
    return bare


def open_pr(forge: LocalForge, repo: str | Path, head: str, body: str = "") -> PullRequest:
    return forge.open_pull_request(str(repo), head_branch=head, base_branch="main",
                                   title=f"change {head}", body=body)


@pytest.fixture
def forge(tmp_path: Path) -> LocalForge:
    return LocalForge(tmp_path / "forge")


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return make_remote(tmp_path, "app", [f"agent/t/r{i}" for i in range(1, 7)] + ["x/feat"])


# -- LocalForge -----------------------------------------------------------------------

def test_numbers_count_per_repository(tmp_path: Path, forge: LocalForge, remote: Path) -> None:
    other = make_remote(tmp_path, "other", ["agent/t/r1"])
    numbers = [open_pr(forge, remote, f"agent/t/r{i}").number for i in (1, 2, 3)]
    assert numbers == [1, 2, 3]
    pr = open_pr(forge, other, "agent/t/r1", body="b")
    assert pr.number == 1
    assert pr == PullRequest(repo=str(other.resolve()), number=1,
                             url=f"forge://{other.resolve()}/pulls/1", head_branch="agent/t/r1",
                             base_branch="main", title="change agent/t/r1", body="b",
                             state="open")
    listed = forge.list_pull_requests(str(remote))
    assert [(p.number, p.head_branch, p.state) for p in listed] == [
        (1, "agent/t/r1", "open"), (2, "agent/t/r2", "open"), (3, "agent/t/r3", "open")]
    assert [p.number for p in forge.list_pull_requests(str(other))] == [1]


def test_second_open_pr_for_a_head_is_refused_until_the_first_is_closed(
        forge: LocalForge, remote: Path) -> None:
    assert open_pr(forge, remote, "agent/t/r1").number == 1
    with pytest.raises(PullRequestExists):
        open_pr(forge, remote, "agent/t/r1", body="again")
    assert len(forge.list_pull_requests(str(remote))) == 1
    closed = forge.close_pull_request(str(remote), 1)
    assert closed.state == "closed"
    assert forge.close_pull_request(str(remote), 1) == closed  # repeating is harmless
    assert open_pr(forge, remote, "agent/t/r1").number == 2
    with pytest.raises(PullRequestExists):
        open_pr(forge, remote, "agent/t/r1")
    assert [(p.number, p.state) for p in forge.list_pull_requests(str(remote))] == [
        (1, "closed"), (2, "open")]
    with pytest.raises(CodeHostError) as exc:
        forge.close_pull_request(str(remote), 99)
    assert exc.value.transient is False


def test_find_by_head_and_marker(forge: LocalForge, remote: Path) -> None:
    repo = str(remote)
    m1, m2 = pr_marker("run-1"), pr_marker("run-2")
    assert forge.find_pull_request(repo, "agent/t/r1", m1) is None
    pr = open_pr(forge, repo, "agent/t/r1", body=f"text\n\n{m1}\n")
    open_pr(forge, repo, "agent/t/r2", body=f"{m2}")
    assert forge.find_pull_request(repo, "agent/t/r1", m1) == pr
    assert forge.find_pull_request(repo, "agent/t/r1", m2) is None  # wrong marker
    assert forge.find_pull_request(repo, "agent/t/r2", m1) is None  # wrong head
    forge.close_pull_request(repo, pr.number)
    found = forge.find_pull_request(repo, "agent/t/r1", m1)
    assert found is not None and (found.number, found.state) == (1, "closed")
    newer = open_pr(forge, repo, "agent/t/r1", body=m1)
    assert forge.find_pull_request(repo, "agent/t/r1", m1) == newer  # the open one wins


def test_paths_and_file_urls_name_one_repository(tmp_path: Path, forge: LocalForge,
                                                 remote: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    open_pr(forge, remote, "agent/t/r1", body=pr_marker("r1"))
    link = tmp_path / "link.git"
    link.symlink_to(remote)
    monkeypatch.chdir(tmp_path)
    spellings = [str(remote), f"{remote}/", f"file://{remote}", f"file://localhost{remote}",
                 str(tmp_path / "sub" / ".." / "app.git"), str(link), "./app.git",
                 f"file://{str(remote).replace('app.git', 'app%2Egit')}"]
    for spelling in spellings:
        assert normalize_repo(spelling) == str(remote.resolve()), spelling
        found = forge.find_pull_request(spelling, "agent/t/r1", pr_marker("r1"))
        assert found is not None and found.number == 1, spelling
        with pytest.raises(PullRequestExists):
            open_pr(forge, spelling, "agent/t/r1")
    assert open_pr(forge, f"file://{remote}", "agent/t/r2").number == 2
    assert len(list((tmp_path / "forge").glob("*.json"))) == 1
    with pytest.raises(CodeHostError):
        normalize_repo("file://otherhost/srv/app.git")


def _lock_waiters(lock_file: Path) -> int:
    """Requests blocked on ``lock_file``'s flock, from /proc/locks ("->" lines)."""
    inode = os.stat(lock_file).st_ino
    waiting = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 1] == "FLOCK":
            device = fields[fields.index("->") + 5]
            waiting += device.rsplit(":", 1)[-1] == str(inode)
    return waiting


def test_a_pull_request_is_not_written_after_the_callers_deadline(forge: LocalForge,
                                                                  remote: Path) -> None:
    """The deadline is checked again under the forge's lock, right before the write:
    a caller whose deadline passed after its git lookups (here while it waited for the
    lock another process held) writes nothing, and may look again (transient). Before,
    the deadline only bounded the git lookup, and the pull request was written late."""
    key = normalize_repo(str(remote))
    lock_file = forge.root / f"{forge._stem(key)}.lock"
    outcome: list[Any] = []

    def opens() -> None:
        try:
            outcome.append(open_pr(forge, remote, "agent/t/r1"))
        except CodeHostError as exc:
            outcome.append(exc)

    opener = threading.Thread(target=opens)
    with forge._locked(key):
        opener.start()
        deadline = time.monotonic() + 60
        while _lock_waiters(lock_file) == 0:  # its lookups done, it waits for the lock
            assert time.monotonic() < deadline and opener.is_alive(), outcome
            time.sleep(0.01)
        forge.set_deadline(time.monotonic())  # the caller's deadline passes meanwhile
    opener.join(timeout=60)
    [refused] = outcome
    assert isinstance(refused, CodeHostError), refused
    assert refused.transient and "no time left to open a pull request" in str(refused)
    assert forge.list_pull_requests(str(remote)) == []
    forge.set_deadline(time.monotonic() + 60)  # in time: written as before
    assert open_pr(forge, remote, "agent/t/r1").number == 1


def test_missing_branches_and_non_repositories_are_refused(tmp_path: Path, forge: LocalForge,
                                                           remote: Path) -> None:
    def refused(repo: str | Path, head: str, base: str = "main") -> CodeHostError:
        with pytest.raises(CodeHostError) as exc:
            forge.open_pull_request(str(repo), head_branch=head, base_branch=base,
                                    title="t", body="b")
        assert exc.value.transient is False
        return exc.value

    assert "does not exist" in str(refused(remote, "agent/t/nope"))
    refused(remote, "feat")  # only x/feat exists: the ref must match exactly, not by suffix
    refused(remote, "agent/t/r1", base="develop")
    refused(remote, "main")  # head == base
    refused(tmp_path / "missing.git", "agent/t/r1")
    (tmp_path / "plain").mkdir()
    assert "not a git repository" in str(refused(tmp_path / "plain", "agent/t/r1"))
    assert forge.list_pull_requests(str(remote)) == []
    assert LocalForge(tmp_path / "f2", check_base=False).open_pull_request(
        str(remote), head_branch="agent/t/r1", base_branch="develop", title="t",
        body="b").number == 1


def test_a_non_bare_repository_works_too(tmp_path: Path, forge: LocalForge) -> None:
    remote = make_remote(tmp_path, "app", ["agent/t/r1"])
    work = tmp_path / "app-work"  # the clone make_remote pushed from
    git("branch", "local-only", cwd=work)
    assert open_pr(forge, work, "local-only").number == 1
    assert open_pr(forge, work, "agent/t/r1").number == 2
    assert forge.list_pull_requests(str(remote)) == []  # a different repository


def test_storage_is_outside_runlane_and_shared_by_instances(tmp_path: Path,
                                                            remote: Path) -> None:
    root = tmp_path / "forge"
    pr = open_pr(LocalForge(root), remote, "agent/t/r1", body="m")
    [data] = list(root.glob("*.json"))
    doc = json.loads(data.read_text())
    assert doc["repo"] == str(remote.resolve())
    assert doc["next_number"] == 2
    assert [p["number"] for p in doc["pulls"]] == [1]
    assert not list(root.glob("*.tmp")) and not list(root.glob(".*.tmp"))
    again = LocalForge(root)  # another "client" of the same service
    assert again.get_pull_request(str(remote), 1) == pr
    with pytest.raises(PullRequestExists):
        open_pr(again, remote, "agent/t/r1")
    data.write_text("{not json")
    with pytest.raises(CodeHostError) as exc:
        again.list_pull_requests(str(remote))
    assert exc.value.transient is False


def test_default_root_comes_from_the_environment(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLANE_FORGE_DIR", str(tmp_path / "env-forge"))
    assert LocalForge().root == tmp_path / "env-forge"
    monkeypatch.delenv("RUNLANE_FORGE_DIR")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert LocalForge().root == tmp_path / "home" / ".local" / "share" / "runlane" / "forge"


def test_threads_opening_different_heads_get_distinct_numbers(forge: LocalForge,
                                                              remote: Path) -> None:
    barrier = threading.Barrier(6)
    numbers: list[int] = []

    def go(i: int) -> None:
        barrier.wait()
        numbers.append(open_pr(forge, remote, f"agent/t/r{i}").number)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(numbers) == [1, 2, 3, 4, 5, 6]
    assert len(forge.list_pull_requests(str(remote))) == 6


def test_readers_never_see_a_partly_written_file(forge: LocalForge, remote: Path) -> None:
    """Readers take no lock: the atomic replace alone must keep them from torn JSON."""
    done = threading.Event()
    errors: list[Exception] = []
    counts: list[int] = []

    def read() -> None:
        while not done.is_set():
            try:
                counts.append(len(forge.list_pull_requests(str(remote))))
            except Exception as exc:
                errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(25):
            pr = open_pr(forge, remote, "agent/t/r1")
            forge.close_pull_request(str(remote), pr.number)
        # Let a reader see the last state (on a loaded machine neither may have read
        # between the last write and the end).
        wait_until(lambda: 25 in counts, 30, "a reader to see all 25 pull requests")
    finally:
        done.set()
        for t in readers:
            t.join()
    assert errors == []
    assert len(counts) > 50 and max(counts) == 25


def _open_in_process(root: str, repo: str, head: str, start: Any, results: Any) -> None:
    """Spawned: wait until every racer is ready, then try to open one pull request."""
    forge = LocalForge(root)
    start.wait(timeout=60)  # a barrier: all processes leave it together
    try:
        pr = open_pr(forge, repo, head, body=pr_marker(head))
        results.put((head, "opened", pr.number))
    except PullRequestExists:
        results.put((head, "exists", 0))
    except Exception as exc:  # reported, then the assertion fails
        results.put((head, f"error {exc!r}", 0))


def race(root: Path, repo: Path, heads: list[str]) -> list[tuple[str, str, int]]:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(len(heads))
    results = ctx.Queue()
    procs = [ctx.Process(target=_open_in_process, args=(str(root), str(repo), h, start, results))
             for h in heads]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


@pytest.mark.slow
def test_processes_racing_for_one_head_open_exactly_one(tmp_path: Path, remote: Path) -> None:
    root = tmp_path / "forge"
    out = race(root, remote, ["agent/t/r1"] * 6)
    assert Counter(kind for _, kind, _ in out) == {"opened": 1, "exists": 5}, out
    prs = LocalForge(root).list_pull_requests(str(remote))
    assert [(p.number, p.head_branch) for p in prs] == [(1, "agent/t/r1")]


@pytest.mark.slow
def test_processes_opening_different_heads_get_distinct_numbers(tmp_path: Path,
                                                                remote: Path) -> None:
    root = tmp_path / "forge"
    out = race(root, remote, [f"agent/t/r{i}" for i in range(1, 7)])
    assert all(kind == "opened" for _, kind, _ in out), out
    assert sorted(n for _, _, n in out) == [1, 2, 3, 4, 5, 6]
    prs = LocalForge(root).list_pull_requests(str(remote))
    assert sorted((p.number, p.head_branch) for p in prs) == sorted(
        (n, h) for h, _, n in out)


# -- GitHubClient against the fake --------------------------------------------------------

TOKEN = "ghp_test_token"
REPO = "https://github.com/octo/app.git"


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub(token=TOKEN, page_size=2) as gh:
        gh.add_repo("octo/app")
        yield gh


@pytest.fixture
def client(fake: FakeGitHub) -> Iterator[GitHubClient]:
    with GitHubClient(fake.url, token=TOKEN, timeout=5) as c:
        yield c


def gh_open(client: GitHubClient, head: str, body: str = "", repo: str = REPO) -> PullRequest:
    return client.open_pull_request(repo, head_branch=head, base_branch="main",
                                    title=f"change {head}", body=body)


def test_open_then_find_by_marker(fake: FakeGitHub, client: GitHubClient) -> None:
    marker = pr_marker("run-1")
    assert client.find_pull_request(REPO, "agent/t/r1", marker) is None
    pr = gh_open(client, "agent/t/r1", body=f"did things\n\n{marker}\n")
    assert pr == PullRequest(repo="octo/app", number=1,
                             url="https://github.com/octo/app/pull/1", head_branch="agent/t/r1",
                             base_branch="main", title="change agent/t/r1",
                             body=f"did things\n\n{marker}\n", state="open")
    assert client.find_pull_request(REPO, "agent/t/r1", marker) == pr
    assert client.find_pull_request("octo/app", "agent/t/r1", marker) == pr
    assert client.find_pull_request(REPO, "agent/t/r1", pr_marker("run-2")) is None
    assert client.find_pull_request(REPO, "agent/t/r2", marker) is None
    posted = [r for r in fake.requests if r.method == "POST"]
    assert [r.path for r in posted] == ["/repos/octo/app/pulls"]
    finds = [r for r in fake.requests if r.method == "GET"]
    assert finds[0].query["head"] == "octo:agent/t/r1"
    assert finds[0].query["state"] == "all"


def test_duplicate_open_head_is_pull_request_exists(fake: FakeGitHub,
                                                    client: GitHubClient) -> None:
    marker = pr_marker("run-1")
    first = gh_open(client, "agent/t/r1", body=marker)
    with pytest.raises(PullRequestExists):
        gh_open(client, "agent/t/r1", body=marker)
    closed = client.close_pull_request(REPO, first.number)
    assert closed.state == "closed"
    second = gh_open(client, "agent/t/r1", body=marker)
    assert second.number == 2
    assert client.find_pull_request(REPO, "agent/t/r1", marker) == second  # open one wins
    client.close_pull_request(REPO, 2)
    found = client.find_pull_request(REPO, "agent/t/r1", marker)
    assert found is not None and (found.number, found.state) == (2, "closed")


def test_find_and_list_follow_pagination(fake: FakeGitHub, client: GitHubClient) -> None:
    marker = pr_marker("run-old")
    fake.seed("octo/app", head="agent/t/r1", body=f"first {marker}", state="closed")
    for i in range(6):  # newer pull requests of the same head push the match to page 4
        fake.seed("octo/app", head="agent/t/r1", body=f"retry {i}", state="closed")
    fake.seed("octo/app", head="agent/t/other", body=marker)  # same marker, other head
    fake.requests.clear()
    found = client.find_pull_request(REPO, "agent/t/r1", marker)
    assert found is not None and (found.number, found.state) == (1, "closed")
    gets = [r for r in fake.requests if r.method == "GET"]
    assert len(gets) == 4  # 7 pull requests, 2 per page
    assert [r.query.get("page", "1") for r in gets] == ["1", "2", "3", "4"]
    fake.requests.clear()
    listed = client.list_pull_requests(REPO)
    assert [p.number for p in listed] == list(range(1, 9))
    assert len(fake.requests) == 4


def test_every_request_carries_the_token_and_api_headers(fake: FakeGitHub,
                                                         client: GitHubClient) -> None:
    gh_open(client, "agent/t/r1")
    client.find_pull_request(REPO, "agent/t/r1", "x")
    client.list_pull_requests(REPO)
    client.close_pull_request(REPO, 1)
    assert {r.method for r in fake.requests} == {"GET", "POST", "PATCH"}
    for r in fake.requests:
        assert r.headers["authorization"] == f"Bearer {TOKEN}"
        assert r.headers["accept"] == "application/vnd.github+json"
        assert r.headers["x-github-api-version"] == "2022-11-28"
        assert r.headers["user-agent"].startswith("runlane")
    with GitHubClient(fake.url, token="wrong", timeout=5) as bad, \
            pytest.raises(CodeHostError) as exc:
        bad.list_pull_requests(REPO)
    assert (exc.value.transient, exc.value.status) == (False, 401)
    with GitHubClient(fake.url, timeout=5) as anonymous, pytest.raises(CodeHostError) as exc:
        gh_open(anonymous, "agent/t/r2")
    assert "authorization" not in fake.requests[-1].headers
    assert (exc.value.transient, exc.value.status) == (False, 401)


def test_server_errors_and_rate_limits_are_transient(fake: FakeGitHub,
                                                     client: GitHubClient) -> None:
    fake.fail_next(1, 500)
    with pytest.raises(CodeHostError) as exc:
        gh_open(client, "agent/t/r1")
    assert (exc.value.transient, exc.value.status, exc.value.retry_after) == (True, 500, None)
    assert gh_open(client, "agent/t/r1").number == 1  # the failed attempt created nothing

    fake.fail_next(2, 503)
    for _ in range(2):
        with pytest.raises(CodeHostError) as exc:
            client.find_pull_request(REPO, "agent/t/r1", "m")
        assert exc.value.transient is True

    fake.fail_next(1, 429, retry_after="7")
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests(REPO)
    assert (exc.value.transient, exc.value.status, exc.value.retry_after) == (True, 429, 7.0)

    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 120))
    fake.fail_next(1, 429, retry_after=when)
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests(REPO)
    assert exc.value.transient and exc.value.retry_after is not None
    assert 100 < exc.value.retry_after <= 121

    reset = str(int(time.time()) + 60)
    fake.fail_next(1, 403, headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset})
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests(REPO)
    assert exc.value.transient and exc.value.retry_after is not None
    assert 50 < exc.value.retry_after <= 61

    for i in range(3):
        gh_open(client, f"agent/t/p{i}")
    fake.fail_next(1, 502, after=1)  # page 1 of 2 answers, page 2 fails
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests(REPO)
    assert (exc.value.transient, exc.value.status) == (True, 502)
    assert [r.query.get("page") for r in fake.requests[-2:]] == [None, "2"]


def test_permanent_errors_are_not_transient(fake: FakeGitHub, client: GitHubClient) -> None:
    fake.fail_next(1, 403)
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests(REPO)
    assert (exc.value.transient, exc.value.status) == (False, 403)
    with pytest.raises(CodeHostError) as exc:
        client.list_pull_requests("octo/missing")
    assert (exc.value.transient, exc.value.status) == (False, 404)
    fake.fail_next(1, 422)  # a validation failure that names no unseen head
    with pytest.raises(CodeHostError) as exc:
        gh_open(client, "agent/t/r1")
    assert not isinstance(exc.value, PullRequestExists)
    assert (exc.value.transient, exc.value.status) == (False, 422)


def test_a_head_github_does_not_see_yet_is_transient(fake: FakeGitHub,
                                                     client: GitHubClient) -> None:
    """Right after a push GitHub may answer 422 ``head`` ``invalid``: retried, not final
    (only on creating a pull request; every other 422 stays permanent)."""
    fake.check_branches = True
    with pytest.raises(CodeHostError) as exc:
        gh_open(client, "agent/t/not-pushed")
    assert not isinstance(exc.value, PullRequestExists)
    assert (exc.value.transient, exc.value.status) == (True, 422)
    fake.branches.add(("octo/app", "agent/t/not-pushed"))
    assert gh_open(client, "agent/t/not-pushed").number == 1


def test_network_failures_are_transient() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with GitHubClient(f"http://127.0.0.1:{port}", token="t", timeout=2) as c, \
            pytest.raises(CodeHostError) as exc:
        c.list_pull_requests("octo/app")
    assert exc.value.transient is True
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with GitHubClient(f"http://127.0.0.1:{silent.getsockname()[1]}", token="t",
                          timeout=0.3) as c:
            t0 = time.monotonic()
            with pytest.raises(CodeHostError) as exc:
                gh_open(c, "agent/t/r1")
            assert time.monotonic() - t0 < 5
    assert exc.value.transient is True


def test_pagination_never_sends_the_token_to_another_host() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json=[], headers={
            "Link": '<https://evil.example/repos/octo/app/pulls?page=2>; rel="next"'})

    with GitHubClient("http://127.0.0.1:9", token="t",
                      transport=httpx.MockTransport(handler)) as c, \
            pytest.raises(CodeHostError) as exc:
        c.list_pull_requests("octo/app")
    assert exc.value.transient is False
    assert all(u.startswith("http://127.0.0.1:9/") for u in seen)


@pytest.mark.parametrize("spelling", [
    "octo/app", "https://github.com/octo/app", "https://github.com/octo/app.git",
    "https://github.com/octo/app/", "git@github.com:octo/app.git",
    "ssh://git@github.com/octo/app.git", "http://github.com/octo/app"])
def test_repository_spellings(spelling: str) -> None:
    assert parse_github_repo(spelling) == ("octo", "app")


@pytest.mark.parametrize("bad", ["app", "https://github.com/octo", "https://github.com/a/b/c",
                                 "octo/app/pulls", "ftp://github.com/octo/app", "-x/app"])
def test_malformed_repositories_are_refused(bad: str) -> None:
    with pytest.raises(CodeHostError) as exc:
        parse_github_repo(bad)
    assert exc.value.transient is False


# -- the factory ------------------------------------------------------------------------------

def test_factory_picks_local_forge_for_paths_and_file_urls(tmp_path: Path, remote: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    env = {"RUNLANE_FORGE_DIR": str(tmp_path / "forge-env")}
    monkeypatch.chdir(tmp_path)
    for repo in (str(remote), f"file://{remote}", "./app.git", "app.git", "~/x.git"):
        host = code_host_for(repo, env=env)
        assert isinstance(host, LocalForge), repo
        assert host.root == tmp_path / "forge-env"
    host = code_host_for(f"file://{remote}", env=env)
    assert isinstance(host, LocalForge)
    open_pr(host, f"file://{remote}", "agent/t/r1")
    assert list((tmp_path / "forge-env").glob("*.json"))


def test_factory_picks_github_for_github_repositories(fake: FakeGitHub) -> None:
    env = {"RUNLANE_GITHUB_API_URL": fake.url, "RUNLANE_GITHUB_TOKEN": TOKEN,
           "GITHUB_TOKEN": "not-this-one"}
    for repo in ("https://github.com/octo/app.git", "git@github.com:octo/app.git", "octo/app"):
        host = code_host_for(repo, env=env)
        assert isinstance(host, GitHubClient), repo
        assert host.base_url == fake.url
        host.close()
    host = code_host_for(REPO, env=env)
    assert isinstance(host, GitHubClient)
    try:
        pr = host.open_pull_request(REPO, head_branch="agent/t/r1", base_branch="main",
                                    title="t", body=pr_marker("r1"))
        assert host.find_pull_request(REPO, "agent/t/r1", pr_marker("r1")) == pr
    finally:
        host.close()
    assert fake.requests[-1].headers["authorization"] == f"Bearer {TOKEN}"
    fallback = code_host_for(REPO, env={"RUNLANE_GITHUB_API_URL": fake.url,
                                        "GITHUB_TOKEN": TOKEN})
    assert isinstance(fallback, GitHubClient)
    with fallback:
        assert [p.number for p in fallback.list_pull_requests(REPO)] == [1]
    default = code_host_for("octo/app", env={})
    assert isinstance(default, GitHubClient)
    assert default.base_url == "https://api.github.com"  # built, never called
    default.close()


def test_factory_refuses_unknown_hosts() -> None:
    for repo in ("https://gitlab.com/o/r.git", "git@bitbucket.org:o/r.git", "not a repo"):
        with pytest.raises(CodeHostError) as exc:
            code_host_for(repo, env={})
        assert exc.value.transient is False, repo


def test_an_owner_name_repository_is_cloned_from_its_github_host(tmp_path: Path,
                                                                   remote: Path) -> None:
    """README: `OWNER/NAME` is a GitHub repository. The worker gave it to `git clone`
    as is, which took it for a local path: every such run failed TASK_CONTRACT_INVALID
    (a review of 2026-12-02). It clones https://HOST/OWNER/NAME.git; URLs and paths on
    disk are cloned as given."""
    assert clone_source("octocat/Hello-World", env={}) == \
        "https://github.com/octocat/Hello-World.git"
    assert clone_source("octocat/Hello-World", env={
        "RUNLANE_GITHUB_API_URL": "https://ghe.example.com/api/v3"}) == \
        "https://ghe.example.com/octocat/Hello-World.git"
    for given in ("https://github.com/octocat/Hello-World", "git@github.com:o/n.git",
                  str(remote), f"file://{remote}"):
        assert clone_source(given, env={}) == given
    # A relative path that exists on disk stays a path.
    (tmp_path / "octo").mkdir()
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "octo" / "app")], check=True)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert clone_source("octo/app", env={}) == "octo/app"
    finally:
        os.chdir(cwd)
