"""Optional dependencies (runlane.extras): runlane on SQLite with local repositories works
without psycopg and httpx, and a feature that needs a missing one is refused with the
extra's install hint, never a traceback.

The packages are installed here, so each check runs in a subprocess whose import system
refuses them (a ``sys.meta_path`` finder raising ModuleNotFoundError, as Python does for
a package that is not installed)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def run_python(code: str, *, blocked: tuple[str, ...], cwd: Path,
               args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER.format(blocked=blocked) + code, *args],
                          capture_output=True, text=True, cwd=cwd, timeout=60, check=False)


def run_cli(*args: str, blocked: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess[str]:
    code = "sys.argv[0] = 'runlane'\nfrom runlane.cli import main\nmain()\n"
    return run_python(code, blocked=blocked, cwd=cwd, args=args)


def test_runlane_imports_without_psycopg_and_httpx(tmp_path: Path) -> None:
    code = """
import runlane, runlane.api, runlane.cli, runlane.codehost, runlane.worker.worker
import runlane.services.scheduler, runlane.store.wakeup, runlane.cli_top, runlane.http.app
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("psycopg", "httpx"))
print("loaded:", loaded)
"""
    proc = run_python(code, blocked=("psycopg", "httpx"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "loaded: []" in proc.stdout


def test_sqlite_and_a_local_repository_work_without_them(tmp_path: Path) -> None:
    repo = tmp_path / "app.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(repo)], check=True)
    db = ("--database-url", f"sqlite:///{tmp_path / 'runlane.db'}")
    blocked = ("psycopg", "httpx")
    upgrade = run_cli(*db, "db", "upgrade", blocked=blocked, cwd=tmp_path)
    assert upgrade.returncode == 0, upgrade.stderr
    submit = run_cli(*db, "submit", "--tenant", "acme", "--repo", str(repo),
                     "--prompt", "hello", "--json", blocked=blocked, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    listed = run_cli(*db, "runs", "list", "--json", blocked=blocked, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "QUEUED" in listed.stdout


def test_a_postgresql_url_without_psycopg_is_refused_with_the_hint(tmp_path: Path) -> None:
    proc = run_cli("--database-url", "postgresql://postgres@127.0.0.1:5432/test", "runs", "list",
                   blocked=("psycopg",), cwd=tmp_path)
    assert proc.returncode == 2
    assert "pip install 'runlane[postgres]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_github_code_host_without_httpx_is_refused_with_the_hint(tmp_path: Path) -> None:
    code = """
from runlane.codehost import CodeHostError, code_host_for
try:
    code_host_for("acme/app", env={})
except CodeHostError as exc:
    print("refused:", exc, "transient:", exc.transient)
"""
    proc = run_python(code, blocked=("httpx",), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout
    assert "pip install 'runlane[github]'" in proc.stdout
    assert "transient: False" in proc.stdout  # a retry would not install it


def test_top_on_a_remote_api_without_httpx_is_refused_with_the_hint(tmp_path: Path) -> None:
    proc = run_cli("top", "--url", "http://127.0.0.1:9/", "--token", "t", "--once",
                   blocked=("httpx",), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'runlane[remote]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_without_the_web_stack_is_refused_with_the_hint(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'runlane.db'}"
    proc = run_cli("--database-url", db, "serve", "--port", "9", blocked=("fastapi", "uvicorn"),
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'runlane[server]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_exporting_traces_without_the_sdk_is_refused_with_the_hint(tmp_path: Path) -> None:
    code = """
from runlane.observability.tracing import build_provider
from runlane.settings import SettingsInvalid
try:
    build_provider({"OTEL_TRACES_EXPORTER": "console"})
except SettingsInvalid as exc:
    print("refused:", exc)
"""
    proc = run_python(code, blocked=("opentelemetry.sdk",), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'runlane[otel]'" in proc.stdout


@pytest.mark.parametrize("package", ["psycopg", "httpx", "opentelemetry-sdk",
                                     "mkdocs", "fastapi"])
def test_optional_packages_are_extras_and_dev_installs_every_extra(package: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith(package) for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(dep.startswith(package) for deps in extras.values() for dep in deps)
    dev = next(dep for dep in extras["dev"] if dep.startswith("runlane["))
    assert set(dev[len("runlane["):-1].split(",")) == set(extras) - {"dev"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_everything_the_dev_install_needs() -> None:
    """`make test` installs with `-c constraints.txt`: every package runlane[dev] needs,
    however deep, has an exact pin there (a new dependency without `make constraints`
    fails here), and the Makefile's install uses the file."""
    pins = _pins()
    assert "runlane" not in pins
    seen: set[tuple[str, frozenset[str]]] = set()
    missing: list[str] = []
    todo = [("runlane", frozenset({"dev"}))]
    while todo:
        name, extras = todo.pop()
        dist = importlib.metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            wanted = req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in (extras or {""}))
            if not wanted:
                continue
            key = canonicalize_name(req.name)
            if key == "runlane":  # dev names the other extras of runlane itself
                if ("runlane", frozenset(req.extras)) not in seen:
                    seen.add(("runlane", frozenset(req.extras)))
                    todo.append(("runlane", frozenset(req.extras)))
                continue
            if key not in pins:
                missing.append(f"{key} (needed by {name})")
            if (key, frozenset(req.extras)) not in seen:
                seen.add((key, frozenset(req.extras)))
                todo.append((key, frozenset(req.extras)))
    assert not missing, f"constraints.txt lacks {sorted(set(missing))}: run make constraints"
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet -c constraints.txt -e '.[dev]'" in makefile
