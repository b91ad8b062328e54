"""Repository identity (domain/repos.py): one canonical form for every spelling of one
repository, idempotent, never holding credentials."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from runlane.domain.repos import canonical_pattern, canonical_repo, github_shorthand_host
from runlane.domain.tasks import validate_repo

# Relative local paths are resolved against this (it never exists: no file system
# lookup makes a hypothesis example depend on the machine).
CWD = "/nonexistent-runlane-cwd"

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
label = st.text(LETTERS + "-", min_size=1, max_size=8).filter(
    lambda s: s[0] != "-" and s[-1] != "-")
hosts = st.one_of(
    st.lists(label, min_size=2, max_size=3).map(".".join),
    st.just("localhost"), st.just("GitHub.com"), st.just("www.github.com"),
    st.just("[::1]"), st.just("[2001:DB8::7]"))
segment = st.one_of(
    st.text(LETTERS + "-_.~", min_size=1, max_size=8),
    st.sampled_from([".", "..", "", ".git", "a.git", "%41", "%2f", "%7E", "...git", "~"]))
paths = st.lists(segment, min_size=1, max_size=4).map("/".join)
users = st.sampled_from(["", "git@", "alice@", "bob:s3cret@", "x-access-token:ghp_TOKEN@"])
ports = st.sampled_from(["", ":22", ":443", ":2222", ":80", ":"])
suffixes = st.sampled_from(["", "/", ".git", ".git/", "//", "?ref=main", "#readme", "/.git"])

urls = st.builds(lambda scheme, user, host, port, path, suffix:
                 f"{scheme}://{user}{host}{port}/{path}{suffix}",
                 st.sampled_from(["https", "http", "ssh", "git", "HTTPS", "Ssh"]),
                 users, hosts, ports, paths, suffixes)
scp = st.builds(lambda user, host, path, suffix: f"{user}{host}:{path}{suffix}",
                st.sampled_from(["git@", "alice@"]), hosts, paths, suffixes)
host_paths = st.builds(lambda host, path: f"{host}/{path}",
                       st.lists(label, min_size=2, max_size=3).map(".".join), paths)
shorthand = st.builds(lambda owner, name: f"{owner}/{name}", label,
                      st.text(LETTERS + "-_.", min_size=1, max_size=10))
local = st.builds(lambda lead, path, suffix: f"{lead}{path}{suffix}",
                  st.sampled_from(["/", "./", "../", "~/", "", "file://", "file:///",
                                   "file://localhost/"]),
                  paths, st.sampled_from(["", "/", ".git", "/."]))
repos = st.one_of(urls, scp, host_paths, shorthand, local)


def canon(text: str) -> str:
    return canonical_repo(text, github_host="github.com", cwd=CWD)


@given(repos)
def test_the_canonical_form_of_a_canonical_form_is_itself(written: str) -> None:
    once = canon(written)
    assert canon(once) == once


@given(st.text(min_size=1, max_size=40))
def test_any_valid_repository_has_an_idempotent_canonical_form(written: str) -> None:
    try:
        validate_repo(written)
    except ValueError:
        assume(False)
    once = canon(written)
    assert canon(once) == once


def spellings(host: str, owner: str, name: str) -> list[str]:
    """Every way a user writes one repository on a host."""
    return [
        f"https://{host}/{owner}/{name}",
        f"https://{host}/{owner}/{name}.git",
        f"https://{host.upper()}/{owner}/{name}/",
        f"https://{host}:443/{owner}/{name}.git/",
        f"http://{host}/{owner}/{name}",
        f"https://user:ghp_SECRET@{host}/{owner}/{name}.git",
        f"git@{host}:{owner}/{name}.git",
        f"git@{host}:/{owner}/{name}",
        f"ssh://git@{host}/{owner}/{name}",
        f"ssh://git@{host}:2222/{owner}/{name}.git",
        f"git://{host}/{owner}/{name}.git",
        f"{host}/{owner}/{name}/",
        f"https://{host}/{owner}/./{name}//",
        f"https://{host}/x/../{owner}/{name}",
        f"https://{host}./{owner}/{name}",
    ]


@given(st.lists(label, min_size=2, max_size=3).map(".".join), label,
       st.text(LETTERS + "-_", min_size=1, max_size=10))
def test_every_spelling_of_one_repository_is_one_identity(host: str, owner: str,
                                                          name: str) -> None:
    forms = {canon(s) for s in spellings(host, owner, name)}
    assert forms == {f"https://{host.lower()}/{owner}/{name}"}


@given(label, st.text(LETTERS + "-_", min_size=1, max_size=10))
def test_github_names_are_case_insensitive_and_owner_name_is_github(owner: str,
                                                                    name: str) -> None:
    want = f"https://github.com/{owner.lower()}/{name.lower()}"
    forms = {canon(s) for s in [*spellings("github.com", owner, name),
                                *spellings("www.github.com", owner.upper(), name),
                                f"{owner}/{name}", f"{owner}/{name}.git",
                                f"git@GitHub.com:{owner.upper()}/{name.upper()}.git"]}
    assert forms == {want}


@given(st.lists(label, min_size=2, max_size=3).map(".".join), label, label)
def test_distinct_repositories_stay_distinct(host: str, owner: str, name: str) -> None:
    assume(host.lower() not in ("github.com", "www.github.com"))
    a = canon(f"https://{host}/{owner}/{name}")
    assert canon(f"https://{host}/{owner}/{name}x") != a
    assert canon(f"https://{host}x/{owner}/{name}") != a
    assert canon(f"https://{host}/{owner}x/{name}") != a
    if name.lower() != name:  # outside GitHub a path keeps its case
        assert canon(f"https://{host}/{owner}/{name.lower()}") != a


@given(urls)
def test_credentials_are_never_part_of_the_identity(written: str) -> None:
    assert "s3cret" not in canon(written) and "TOKEN" not in canon(written)
    assert "@" not in canon(written)


def test_the_four_spellings_of_the_issue_are_one_identity() -> None:
    forms = {canon(s) for s in ["https://github.com/acme/app",
                                "https://github.com/acme/app.git",
                                "git@github.com:acme/app.git", "github.com/acme/app/"]}
    assert forms == {"https://github.com/acme/app"}


def test_owner_name_follows_github_enterprise() -> None:
    ghe = github_shorthand_host("https://ghe.example.com/api/v3")
    assert ghe == "ghe.example.com"
    assert github_shorthand_host(None) == "github.com"
    assert canonical_repo("acme/App", github_host=ghe, cwd=CWD) \
        == canonical_repo("git@GHE.example.com:Acme/app.git", github_host=ghe, cwd=CWD) \
        == "https://ghe.example.com/acme/app"


def test_a_percent_escape_of_a_letter_is_the_letter() -> None:
    assert canon("https://git.example.com/acme/%61pp") == "https://git.example.com/acme/app"
    assert canon("https://git.example.com/acme/a%2fb") == "https://git.example.com/acme/a%2Fb"


def test_local_paths_resolve_symbolic_links_file_urls_and_relative_paths(
        tmp_path: Path) -> None:
    real = tmp_path / "git" / "app.git"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "git")
    cwd = str(tmp_path / "git")
    forms = {canonical_repo(s, cwd=cwd) for s in [
        str(real), f"{real}/", f"{real}//", str(tmp_path / "link" / "app.git"),
        f"file://{real}", f"file://localhost{tmp_path}/link/app.git/",
        f"{tmp_path}/git/../git/app.git", "./app.git", "app.git", "../link/app.git",
        f"file://{tmp_path}/git/app%2Egit"]}
    assert forms == {str(real.resolve())}
    # .git is part of a local path: /srv/app.git and /srv/app are two directories
    assert canonical_repo(str(tmp_path / "git" / "app"), cwd=cwd) != str(real.resolve())


def test_a_relative_name_that_exists_is_a_local_path_not_github(tmp_path: Path) -> None:
    (tmp_path / "acme" / "app").mkdir(parents=True)
    assert canonical_repo("acme/app", cwd=str(tmp_path)) == str(tmp_path / "acme" / "app")
    assert canonical_repo("acme/other", cwd=str(tmp_path)) == "https://github.com/acme/other"


def test_home_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert canonical_repo("~/app.git", cwd=CWD) == str(tmp_path.resolve() / "app.git")


# --- patterns ------------------------------------------------------------------------


def pattern(text: str) -> str:
    return canonical_pattern(text, github_host="github.com", cwd=CWD)


@pytest.mark.parametrize(("written", "canonical"), [
    ("git@github.com:acme/*", "https://github.com/acme/*"),
    ("git@github.com:acme/*.git", "https://github.com/acme/*"),
    ("https://GitHub.com/Acme/App.git", "https://github.com/acme/app"),
    ("ssh://git@git.example.com:2222/grp/*", "https://git.example.com/grp/*"),
    ("acme/*", "https://github.com/acme/*"),
    ("acme/pay-?", "https://github.com/acme/pay-?"),
    ("https://*.example.com/acme/*", "https://*.example.com/acme/*"),
    ("https://[ab]c.example.com/x", "https://[ab]c.example.com/x"),
    ("*/payments-*", "*/payments-*"),  # no host or path to normalise: as written
    ("?x/*", "?x/*"),
    ("/srv/git/../git/*.git", "/srv/git/*.git"),
])
def test_patterns_are_read_as_repositories_with_their_globs_kept(written: str,
                                                                  canonical: str) -> None:
    assert pattern(written) == canonical
    assert pattern(canonical) == canonical


@given(st.one_of(urls, scp, host_paths, shorthand))
def test_a_literal_pattern_is_the_repository_it_names(written: str) -> None:
    assume(not any(ch in written for ch in "*?["))
    assert pattern(written) == canon(written)


@given(st.one_of(repos, st.text(min_size=1, max_size=30)))
def test_the_canonical_form_of_a_canonical_pattern_is_itself(written: str) -> None:
    once = pattern(written)
    assert pattern(once) == once


def test_the_symlinks_of_a_local_pattern_are_resolved(tmp_path: Path) -> None:
    (tmp_path / "git").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "git")
    assert canonical_pattern(f"{tmp_path}/link/secret.git") \
        == canonical_repo(f"{tmp_path}/git/secret.git") == str((tmp_path / "git").resolve()
                                                               / "secret.git")
    assert os.path.isabs(canonical_pattern("./x/*", cwd=str(tmp_path)))
