"""The documentation stands alone: the site builds in strict mode (a broken link, a
missing anchor or a page left out of the nav fails), its generated tables match the
code, and no document (README.md, CHANGELOG.md, docs/*.md, the commands' --help)
names a file that is not in the repository or sends a reader to the team's own
design files."""

from __future__ import annotations

import html
import inspect
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from runlane.api import Runlane
from runlane.cli import app
from runlane.domain.states import TRANSITIONS
from runlane.settings import Settings

# One worker builds the site once for the whole module (`make test` uses --dist loadgroup).
pytestmark = pytest.mark.xdist_group("docs")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

# A path into the repository, written in prose or code: docs/x.md, bench/y.py, tests/z.py...
REPO_PATH = re.compile(
    r"(?<![\w./~$-])((?:docs|bench|tests|src|examples|deploy|\.ci)/[\w./-]*[\w])")
# A file named in backticks: `store/evidence.py`, `migrate.py`, `examples/policy.toml`.
CODE_FILE = re.compile(r"`([\w./-]+\.(?:py|md|toml|yml|yaml|ini|txt|json|sql))`")
# Files of the user's, not of the repository.
USER_FILES = {"runlane.toml", "tasks.jsonl", "policy.toml", "/openapi.json"}
# Where a path in backticks may be relative to.
CODE_BASES = [ROOT, ROOT / "src", ROOT / "src" / "runlane", ROOT / "tests", ROOT / "bench"]
# A Markdown link's target.
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A test named in backticks.
TEST_NAME = re.compile(r"`(test_\w+)`")
# What only the team has: a reader of the product's documents has none of these.
TEAM_FILES = re.compile(r"DESIGN\.md|CONTRACT\.md|\bseeds?/|\bseed 000|/work/shared")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_site_builds_in_strict_mode(site: Path) -> None:
    for page in ("index", "getting-started", "concepts", "agent-protocol", "policy",
                 "settings", "running", "cli", "python-api", "benchmarks"):
        assert (site / page / "index.html").exists() or page == "index"
    assert (site / "index.html").exists()


def test_the_state_table_is_the_transition_table(site: Path) -> None:
    page = (site / "concepts" / "index.html").read_text()
    rows = re.findall(r"<tr>\s*<td><code>([A-Z_]+)</code></td>\s*<td>[^<]*</td>\s*"
                      r"<td>(.*?)</td>\s*</tr>", page, re.S)
    shown = {source: set(re.findall(r"<code>([A-Z_]+)</code>", targets))
             for source, targets in rows}
    assert shown == {s.value: {t.value for t in targets} for s, targets in TRANSITIONS.items()}


def test_the_settings_table_names_every_setting_and_its_default(site: Path) -> None:
    text = _text(site / "settings" / "index.html")
    for name, field in Settings.model_fields.items():
        assert f"RUNLANE_{name.upper()}" in text
        default = field.default
        if isinstance(default, int | float) and not isinstance(default, bool):
            shown = str(int(default)) if float(default).is_integer() else str(default)
            assert re.search(rf"RUNLANE_{name.upper()}\s+{shown}\s", text), name


def test_the_references_are_generated_from_the_code(site: Path) -> None:
    cli = _text(site / "cli" / "index.html")
    for name in app.commands:  # type: ignore[attr-defined]
        assert f"runlane {name}" in cli
    api = (site / "python-api" / "index.html").read_text()
    methods = [name for name, _ in inspect.getmembers(Runlane, callable)
               if not name.startswith("_")]
    assert "cancel" in methods and "submit" in methods
    missing = [m for m in methods if f'id="runlane.api.Runlane.{m}"' not in api]
    assert not missing, f"the Python API reference lacks Runlane.{missing}"


def test_the_site_sends_nobody_to_the_teams_files(site: Path) -> None:
    """Generated pages too (docstrings, --help): nothing names DESIGN.md, CONTRACT.md
    or the seed documents."""
    for page in site.rglob("*.html"):
        found = TEAM_FILES.search(_text(page))
        assert found is None, f"{page.relative_to(site)}: {found.group(0) if found else ''}"


def _help_texts() -> dict[str, str]:
    """Every command's help and its options' help, as written (not wrapped)."""
    texts = {}

    def walk(command: click.Command, path: list[str]) -> None:
        helps = [command.help or "", command.short_help or "", command.epilog or ""]
        helps += [getattr(param, "help", None) or "" for param in command.params]
        texts[" ".join(path)] = "\n".join(helps)
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(app, ["runlane"])
    return texts


DOCUMENT_IDS = [_name(p) for p in DOCUMENTS]


@pytest.mark.parametrize("document", DOCUMENTS, ids=DOCUMENT_IDS)
def test_a_document_names_only_files_that_exist(document: Path) -> None:
    text = document.read_text()
    missing = []
    for match in REPO_PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if not (ROOT / path).exists():
            missing.append(f"line {text[:match.start()].count(chr(10)) + 1}: {path}")
    for match in CODE_FILE.finditer(text):
        path = match.group(1)
        if path in USER_FILES or any((base / path).exists() for base in
                                     [*CODE_BASES, document.parent]):
            continue
        if "/" not in path and any((ROOT / "src").rglob(path)):
            continue  # a module named by its file name alone (`migrate.py`)
        missing.append(f"line {text[:match.start()].count(chr(10)) + 1}: {path}")
    for match in LINK.finditer(text):
        target = match.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (document.parent / target).exists():
            missing.append(f"line {text[:match.start()].count(chr(10)) + 1}: link {target}")
    assert not missing, f"{_name(document)} names what does not exist: {missing}"


@pytest.fixture(scope="module")
def test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").glob("*.py"):
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("document", DOCUMENTS, ids=DOCUMENT_IDS)
def test_a_document_cites_only_tests_that_exist(document: Path, test_names: set[str]) -> None:
    cited = set(TEST_NAME.findall(document.read_text()))
    assert not cited - test_names, f"{_name(document)}: no such test {sorted(cited - test_names)}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=DOCUMENT_IDS)
def test_a_document_sends_nobody_to_the_teams_files(document: Path) -> None:
    found = [m.group(0) for m in TEAM_FILES.finditer(document.read_text())]
    assert not found, f"{_name(document)}: {found}"


def test_help_texts_name_only_files_that_exist_and_none_of_the_teams() -> None:
    texts = _help_texts()
    assert len(texts) > 20
    for command, text in texts.items():
        assert TEAM_FILES.search(text) is None, command
        for match in REPO_PATH.finditer(text):
            assert (ROOT / match.group(1).rstrip(".")).exists(), f"{command}: {match.group(1)}"


def test_every_benchmark_script_has_its_section() -> None:
    """docs/benchmarks.md has a section per script of bench/ that measures something,
    naming the command that regenerates it."""
    report = (DOCS / "benchmarks.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    missing = [s for s in scripts if f"bench/{s}" not in report]
    assert not missing, f"docs/benchmarks.md has no section for {missing}"
