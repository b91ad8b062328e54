"""The dashboard in a real browser: Debian's chromium driven by Playwright against a
real ``runlane serve`` process on each engine. Sign-in, the runs page against the
database, live updates over the event stream, the cancel button, tenant isolation,
and no horizontal scroll at 390 px. Screenshots of every page go to
``test-artifacts/dashboard/`` (or $RUNLANE_TEST_ARTIFACTS) to be looked at."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runlane.api import Runlane

playwright_api = pytest.importorskip("playwright.sync_api")

pytestmark = [pytest.mark.xdist_group("browser"), pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
# The machine's network is closed: nothing of chromium may try to reach it.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("RUNLANE_TEST_ARTIFACTS")
                 or Path(__file__).resolve().parent.parent / "test-artifacts") / "dashboard"
SECRET_REPO = "https://deploy:ghp_SECRET0123456789@git.example.com/acme/app.git"
WIDE, NARROW = (1280, 900), (390, 844)


@dataclass
class Served:
    url: str
    lane: Runlane
    tokens: dict[str, str]  # "admin", "acme", "acme-read", "globex" → secret
    engine: str

    def submit(self, token: str, tenant: str, prompt: str,
               repo: str = SECRET_REPO) -> dict[str, Any]:
        """A task through the HTTP API, as a client would submit it."""
        answer = httpx.post(f"{self.url}/v1/tasks", timeout=10,
                            headers={"Authorization": f"Bearer {self.tokens[token]}"},
                            json={"tenant": tenant, "repo": repo, "prompt": prompt})
        assert answer.status_code == 201, answer.text
        result: dict[str, Any] = answer.json()
        return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"runlane serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"runlane serve did not answer at {url} within {timeout}s")


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    """``runlane serve`` on the test's database, with tokens of two tenants."""
    lane = Runlane(db_url)
    tokens = {
        "admin": lane.create_token(role="admin", name="ops").token,
        "acme": lane.create_token(role="submit", tenant="acme").token,
        "acme-read": lane.create_token(role="read", tenant="acme").token,
        "acme-approve": lane.create_token(role="approve", tenant="acme").token,
        "globex": lane.create_token(role="submit", tenant="globex").token,
    }
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RUNLANE_DATABASE_URL": db_url,
           "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
           "RUNLANE_EVENTS_POLL_SECONDS": "0.2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runlane", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_until_up(url, proc)
        yield Served(url=url, lane=lane, tokens=tokens,
                     engine="sqlite" if db_url.startswith("sqlite") else "postgresql")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lane.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (make test does)")
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser: Any, served: Served) -> Iterator[Any]:
    """``open_page(size)``: a new browser context's page on the served dashboard. Each
    is closed before the server stops (an open event stream would keep the stopping
    server waiting out its graceful shutdown)."""
    contexts: list[Any] = []

    def opened(size: tuple[int, int] = WIDE) -> Any:
        context = browser.new_context(viewport={"width": size[0], "height": size[1]},
                                      base_url=served.url)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(10_000)
        return page

    yield opened
    for context in contexts:
        context.close()


def _sign_in(page: Any, token: str) -> None:
    page.goto("/login")
    page.fill("#token", token)
    page.click("form[action='/login'] button[type=submit]")
    page.wait_for_url(re.compile(r".*/runs$"))


def _shot(page: Any, name: str, served: Served) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}-{served.engine}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def _claim(served: Served, run_id: str) -> None:
    """An attempt for ``run_id``: a worker registers and claims it (no agent runs)."""
    store = served.lane.store
    store.register_worker("w-dash-1", version="test", queues=["default"],
                          capabilities={"os": "linux"})
    assert [lease.run_id for lease in store.claim("w-dash-1", run_id=run_id)] == [run_id]


def _shown_run_ids(page: Any) -> set[str]:
    return set(page.eval_on_selector_all("tr[data-run]", "rows => rows.map(r => r.dataset.run)"))


def test_sign_in_sets_a_strict_http_only_cookie_and_sign_out_ends_it(
        open_page: Any, served: Served) -> None:
    page = open_page()
    page.goto("/runs")
    assert page.url.endswith("/login"), "an anonymous visit goes to the sign-in page"
    _shot(page, "login", served)

    page.fill("#token", served.tokens["acme"] + "x")
    page.click("form[action='/login'] button[type=submit]")
    assert page.locator(".error").inner_text().startswith("That token is not valid")
    assert page.context.cookies() == []

    _sign_in(page, served.tokens["acme"])
    (cookie,) = page.context.cookies()
    assert cookie["name"] == "runlane_session"
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/"
    assert cookie["secure"] is False  # plain http here; Secure when served over https
    assert page.evaluate("document.cookie") == "", "page scripts cannot read the session"
    assert "acme · submit" in page.locator(".who").inner_text()

    page.click("form[action='/logout'] button")
    page.wait_for_url(re.compile(r".*/login\?notice=signed-out$"))
    assert page.context.cookies() == []
    page.goto("/runs")
    assert page.url.endswith("/login")


def test_a_revoked_token_signs_the_browser_out(open_page: Any, served: Served) -> None:
    page = open_page()
    _sign_in(page, served.tokens["acme-read"])
    (info,) = [t for t in served.lane.tokens() if t.tenant == "acme" and t.role == "read"]
    served.lane.revoke_token(info.token_id)
    page.goto("/runs")
    assert "/login" in page.url
    assert "session ended" in page.locator(".notice").inner_text()


def test_runs_page_lists_what_the_database_holds(open_page: Any, served: Served) -> None:
    for n in range(3):
        served.submit("acme", "acme", f"acme task {n}")
    served.submit("globex", "globex", "globex task")
    page = open_page()
    _sign_in(page, served.tokens["admin"])
    held = {r["run_id"] for r in served.lane.runs()}
    assert len(held) == 4
    assert _shown_run_ids(page) == held
    content = page.content()
    assert "ghp_SECRET0123456789" not in content, "repository credentials are masked"
    assert "git.example.com/acme/app" in content
    _shot(page, "runs", served)

    page.select_option("select[name=status]", "QUEUED")
    page.fill("input[name=tenant]", "globex")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r".*tenant=globex.*"))
    assert _shown_run_ids(page) == {r["run_id"] for r in served.lane.runs(tenant="globex")}


def test_runs_page_pages_by_cursor(open_page: Any, served: Served) -> None:
    submitted = [served.submit("acme", "acme", f"task {n}")["run_id"] for n in range(5)]
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    page.goto("/runs?limit=2")
    seen: list[str] = []
    while True:
        seen.extend(page.eval_on_selector_all(
            "tr[data-run]", "rows => rows.map(r => r.dataset.run)"))
        older = page.locator("a[rel=next]")
        if older.count() == 0:
            break
        older.click()
        page.wait_for_load_state()
    assert sorted(seen) == sorted(submitted)
    assert len(seen) == len(set(seen)), "no run shown twice across pages"


def test_a_new_run_and_its_status_changes_appear_live(open_page: Any, served: Served) -> None:
    """A run submitted through the API shows on an open page within 2 s without a
    reload; another tenant's, submitted first, never does; a cancel changes its badge."""
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    page.locator("#live").wait_for(state="visible")  # the event stream is open
    page.evaluate("window.__same_document = true")
    # A second reader of the same stream, with the same cookie: what the browser gets.
    page.evaluate("""() => {
        window.__events = [];
        window.__stream = new EventSource('/v1/events');
        window.__stream.onmessage = m => window.__events.push(JSON.parse(m.data));
    }""")
    page.wait_for_function("() => window.__stream.readyState === 1")

    other = served.submit("globex", "globex", "not for acme's eyes")
    mine = served.submit("acme", "acme", "shows up live")
    started = time.monotonic()
    page.locator(f"tr[data-run='{mine['run_id']}']").wait_for(timeout=2_000)
    assert time.monotonic() - started <= 2.0
    assert page.evaluate("window.__same_document === true"), "no reload happened"
    assert other["run_id"] not in _shown_run_ids(page)
    assert "not for acme" not in page.content()
    page.wait_for_function(
        f"() => window.__events.some(e => e.run_id === {mine['run_id']!r})", timeout=2_000)
    streamed = page.evaluate("window.__events")
    assert {e["tenant"] for e in streamed} == {"acme"}, "the stream is the token's scope"

    served.lane.cancel(mine["task_id"])
    badge = page.locator(f"tr[data-run='{mine['run_id']}'] [data-field=status]")
    badge.filter(has_text="CANCELLED").wait_for(timeout=2_000)
    assert page.evaluate("window.__same_document === true")
    assert other["run_id"] not in _shown_run_ids(page)
    _shot(page, "runs-live", served)


def test_the_cancel_button_cancels(open_page: Any, served: Served) -> None:
    mine = served.submit("acme", "acme", "to be cancelled")
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    page.goto(f"/runs/{mine['run_id']}")
    assert "ghp_SECRET0123456789" not in page.content()
    assert "git.example.com/acme/app" in page.content()
    _shot(page, "run", served)
    page.click("#cancel")
    page.wait_for_url(re.compile(r".*\?notice=cancel$"))
    deadline = time.monotonic() + 5
    while served.lane.run(mine["run_id"]).status != "CANCELLED":
        assert time.monotonic() < deadline, served.lane.run(mine["run_id"]).status
        time.sleep(0.05)
    assert "Cancellation requested" in page.locator(".notice").inner_text()
    assert page.locator("#cancel").count() == 0, "no cancel button on a finished run"
    _shot(page, "run-cancelled", served)

    page.click("#retry")
    page.wait_for_url(re.compile(r".*/runs/[^/?]+\?notice=retry$"))
    retried = page.url.rsplit("/", 1)[1].split("?")[0]
    assert retried != mine["run_id"]
    assert served.lane.run(retried).retry_of_run_id == mine["run_id"]
    assert served.lane.run(retried).task_id == mine["task_id"]


def test_an_admin_drains_a_worker_and_a_tenant_cannot(open_page: Any, served: Served) -> None:
    served.lane.store.register_worker("w-drain-1", version="test", queues=["default"])
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    page.goto("/workers")
    assert page.locator("form[action$='/drain']").count() == 0, "no drain for a tenant"
    csrf = page.locator("form[action='/logout'] input[name=csrf]").input_value()
    answer = page.request.post("/workers/w-drain-1/drain", form={"csrf": csrf},
                               headers={"Origin": served.url}, max_redirects=0)
    assert answer.status in (403, 404)
    (worker,) = served.lane.workers()
    assert worker.drain_requested_at is None, "nothing changed"

    admin = open_page()
    _sign_in(admin, served.tokens["admin"])
    admin.goto("/workers")
    admin.click("#worker-w-drain-1 form[action$='/drain'] button")
    admin.wait_for_url(re.compile(r".*/workers\?notice=drain$"))
    (worker,) = served.lane.workers()
    assert worker.drain_requested_at is not None
    assert admin.locator("#worker-w-drain-1 form[action$='/drain']").count() == 0


def test_a_read_token_sees_no_buttons_and_cannot_cancel(open_page: Any, served: Served) -> None:
    mine = served.submit("acme", "acme", "read only")
    page = open_page()
    _sign_in(page, served.tokens["acme-read"])
    page.goto(f"/runs/{mine['run_id']}")
    assert page.locator("#cancel").count() == 0
    assert page.locator("#retry").count() == 0
    # The form posted anyway (the session's own CSRF token, this origin): refused.
    csrf = page.locator("form[action='/logout'] input[name=csrf]").input_value()
    answer = page.request.post(f"/runs/{mine['run_id']}/cancel", form={"csrf": csrf},
                               headers={"Origin": served.url}, max_redirects=0)
    assert answer.status == 403
    assert served.lane.run(mine["run_id"]).status == "QUEUED"


def test_an_approver_approves_and_rejects_on_the_run_page(open_page: Any,
                                                         served: Served) -> None:
    served.lane.apply_policy('[[approvals]]\nname = "every run"\n')
    first = served.submit("acme", "acme", "needs a look")
    second = served.submit("acme", "acme", "needs another look")
    theirs = served.submit("globex", "globex", "theirs")
    assert first["status"] == "AWAITING_APPROVAL"
    submitter = open_page()
    _sign_in(submitter, served.tokens["acme"])
    submitter.goto(f"/runs/{first['run_id']}")
    assert submitter.locator("#approve").count() == 0  # a submitter never approves
    page = open_page()
    _sign_in(page, served.tokens["acme-approve"])
    page.goto(f"/runs/{first['run_id']}")
    assert "waiting until" in page.locator("#approval").inner_text()
    _shot(page, "run-awaiting-approval", served)
    page.fill("#approve-note", "looks fine")
    page.click("#approve")
    page.wait_for_url(re.compile(r".*\?notice=approve$"))
    assert served.lane.run(first["run_id"]).status == "QUEUED"
    assert "APPROVED" in page.locator("#approval").inner_text()
    assert "looks fine" in page.locator("#approval").inner_text()
    assert page.locator("#approve").count() == 0  # decided: no more buttons
    page.goto(f"/runs/{second['run_id']}")
    page.click("#reject")
    page.wait_for_url(re.compile(r".*\?notice=reject$"))
    assert served.lane.run(second["run_id"]).status == "POLICY_DENIED"
    # Another tenant's run: as unknown as no run at all, and a forged form changes nothing.
    answer = page.goto(f"/runs/{theirs['run_id']}")
    assert answer is not None and answer.status == 404
    csrf = page.locator("form[action='/logout'] input[name=csrf]").input_value()
    forged = page.request.post(f"/runs/{theirs['run_id']}/approve", form={"csrf": csrf},
                               headers={"Origin": served.url}, max_redirects=0)
    assert forged.status == 404
    assert served.lane.run(theirs["run_id"]).status == "AWAITING_APPROVAL"


def test_a_tenant_never_sees_another_tenants_run(open_page: Any, served: Served) -> None:
    theirs = served.submit("globex", "globex", "globex secret plan")
    mine = served.submit("acme", "acme", "acme work")
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    assert _shown_run_ids(page) == {mine["run_id"]}
    page.goto("/runs?tenant=globex")  # a filter cannot widen a tenant's scope
    assert theirs["run_id"] not in _shown_run_ids(page)
    assert "globex secret plan" not in page.content()
    for path in (f"/runs/{theirs['run_id']}", f"/runs/{theirs['run_id']}/row"):
        answer = page.goto(path)
        assert answer is not None and answer.status == 404, path
        assert "globex secret plan" not in page.content()
    missing = page.goto("/runs/01NOSUCHRUN0000000000000000")
    assert missing is not None and missing.status == 404
    _shot(page, "not-found", served)
    # Cancelling it by a forged form with the session's own CSRF token: 404, unchanged.
    page.goto("/runs")
    csrf = page.locator("form[action='/logout'] input[name=csrf]").input_value()
    answer = page.request.post(f"/runs/{theirs['run_id']}/cancel", form={"csrf": csrf},
                               headers={"Origin": served.url}, max_redirects=0)
    assert answer.status == 404
    assert served.lane.run(theirs["run_id"]).status == "QUEUED"


POLICY = """
allow_unknown_tenants = true
[concurrency]
per_tenant_max_active = 20
[tenants.acme]
weight = 2.0
max_active = 5
daily_model_budget_usd = 25
"""


def _apply_policy(served: Served, tmp_path: Path) -> int:
    """The policy above through `runlane policy apply`, as an operator would: its
    version in force."""
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    env = {**os.environ, "RUNLANE_DATABASE_URL": str(served.lane.settings.database_url)}
    subprocess.run([sys.executable, "-m", "runlane", "policy", "apply", str(path)],
                   env=env, check=True, capture_output=True)
    version: int = served.lane.policy().version
    return version


PAGES = ["/runs", "/runs/{run}", "/workers", "/queues", "/policy"]


@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["1280", "390"])
def test_every_page_fits_the_screen(open_page: Any, served: Served, tmp_path: Path,
                                    size: tuple[int, int]) -> None:
    """No horizontal scroll at 390 px (nor at 1280), with long ids and URLs; the
    policy page shows the version in force."""
    version = _apply_policy(served, tmp_path)
    run = served.submit("acme", "acme", "a long prompt " * 40,
                        repo=SECRET_REPO.replace("app.git", "a-rather-long-repository-name-"
                                                 "that-would-overflow-a-phone-screen.git"))
    _claim(served, run["run_id"])
    page = open_page(size)
    _sign_in(page, served.tokens["admin"])
    for path in PAGES:
        page.goto(path.format(run=run["run_id"]))
        width, client = page.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert width <= client, f"{path} scrolls sideways at {size[0]} px: {width} > {client}"
        if path == "/policy":
            assert page.locator("#policy-version").inner_text() == str(version)
        name = path.strip("/").split("/")[0] + ("-detail" if "{run}" in path else "")
        _shot(page, f"{name}-{size[0]}", served)
    page.goto("/login")  # signed in: still renders
    _shot(page, f"login-{size[0]}", served)

    tenant = open_page(size)  # what a tenant's token sees of the fleet
    _sign_in(tenant, served.tokens["acme-read"])
    for path in ("/queues", "/policy", "/workers"):
        tenant.goto(path)
        width, client = tenant.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert width <= client, f"{path} scrolls sideways at {size[0]} px"
        _shot(tenant, f"tenant-{path.strip('/')}-{size[0]}", served)
    assert tenant.locator("form[action$='/drain']").count() == 0


def test_headers_csrf_and_origin(served: Served) -> None:
    """Through plain HTTP: the headers every page carries, and the refusals of forms
    without the session's CSRF token or from another origin (nothing changed)."""
    mine = served.submit("acme", "acme", "csrf target")
    with httpx.Client(base_url=served.url, timeout=10) as client:
        login = client.get("/login")
        csp = login.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp
        assert login.headers["x-frame-options"] == "DENY"
        assert login.headers["referrer-policy"] == "same-origin"
        assert "<script>" not in login.text, "no inline script"

        # Sign-in from another site's page (login CSRF): refused, no cookie.
        foreign = client.post("/login", data={"token": served.tokens["acme"]},
                              headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
        signed = client.post("/login", data={"token": served.tokens["acme"]},
                             headers={"Origin": served.url})
        assert signed.status_code == 303
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        page = client.get(f"/runs/{mine['run_id']}")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        assert csrf is not None

        target = f"/runs/{mine['run_id']}/cancel"
        same = {"Origin": served.url}
        assert client.post(target, headers=same).status_code == 403  # no token
        assert client.post(target, data={"csrf": "0" * 64}, headers=same).status_code == 403
        assert client.post(target, data={"csrf": csrf.group(1)},
                           headers={"Origin": "http://evil.example"}).status_code == 403
        assert client.post(target, data={"csrf": csrf.group(1)}).status_code == 403  # no Origin
        assert served.lane.run(mine["run_id"]).status == "QUEUED", "nothing changed"

        # The session cookie reads the API (the event stream) but never writes through it.
        assert client.get(f"/v1/runs/{mine['run_id']}").status_code == 200
        write = client.post(f"/v1/tasks/{mine['task_id']}/cancel", headers=same)
        assert write.status_code == 401
        assert served.lane.run(mine["run_id"]).status == "QUEUED"

        done = client.post(target, data={"csrf": csrf.group(1)}, headers=same)
        assert done.status_code == 303
        assert served.lane.run(mine["run_id"]).status == "CANCELLED"


def test_the_run_page_shows_the_tail_of_the_agent_log_masked(
        open_page: Any, served: Served, tmp_path: Path) -> None:
    mine = served.submit("acme", "acme", "with a log")
    folder = tmp_path / "artifacts" / mine["run_id"] / "1"
    folder.mkdir(parents=True)
    lines = [f"line {n}" for n in range(5000)]
    lines.append("pushing to https://bot:ghs_TOKEN42@github.com/acme/app.git")
    (folder / "agent.log").write_text("\n".join(lines) + "\n")
    _claim(served, mine["run_id"])
    page = open_page()
    _sign_in(page, served.tokens["acme"])
    page.goto(f"/runs/{mine['run_id']}")
    text = page.locator("details.log pre").inner_text()
    assert "ghs_TOKEN42" not in text and "https://***@github.com" in text
    assert "line 4999" in text and "line 0\n" not in text


def test_chromium_is_debians(browser: Any) -> None:
    """The browser these tests drive is the system's chromium, not a download."""
    shown = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True,
                           check=True).stdout
    assert browser.version in shown
