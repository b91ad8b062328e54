"""What an agent sees of the machine: bwrap's mount arguments for one attempt.

An allowlist, not a deny-list. We run as root in many deployments, and a process
running as root reads every root-owned file it can see, mode 0600 or not
(``/etc/shadow``, ``/etc/ssl/private``, ``/root/.git-credentials``); a deny-list would
have to name every such file on every machine and would miss the next one. So the
sandbox starts from an empty root and binds in only:

* the system: ``/usr`` and the root's ``/bin``, ``/sbin``, ``/lib*`` (symlinks on a
  merged-/usr system), and a short list of ``/etc`` entries programs need to run and
  to reach the network (:data:`ETC_ALLOWLIST`; no ``shadow``, no ``ssl/private``, no
  ``ssh``, no ``pip.conf`` or ``npmrc``, which may hold index credentials);
* read-only extras: the worker's own Python (so ``python -m runlane.demo_agent`` runs)
  and the operator's ``SANDBOX_READ_ONLY_PATHS``;
* read-write: the attempt's workspace and artifacts directory;
* fresh and private: ``/proc`` (of the sandbox's PID namespace), a minimal ``/dev``,
  ``/tmp`` (with ``HOME`` in it).

Hidden paths (the SQLite file, ``runlane.toml``, the worker's home, the forge, the
workspace and artifacts roots) are invisible unless one lies under a visible path:
then it is masked (an empty read-only directory, or ``/dev/null`` for a file).

Every operation is placed by the depth of its destination, so the most specific path
decides: a mask under a visible directory hides, a visible path under a mask shows
again (the worker's Python under a masked home), and at equal depth a mask beats a
read-only bind and the workspace beats a mask.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ALLOWLIST = (
    "passwd", "group", "hosts", "hostname", "resolv.conf", "nsswitch.conf", "host.conf",
    "gai.conf", "services", "protocols", "networks", "localtime", "timezone",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl/certs",
    "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "pki/tls/certs",
    "pki/ca-trust", "crypto-policies", "os-release", "debian_version", "lsb-release",
    "mime.types", "gitconfig", "terminfo", "locale.alias", "locale.conf",
)
HOME = "/tmp/home"  # the agent's HOME: inside its private /tmp
SECRETS_DIR = "/run/secrets"

# Order at equal depth: fresh file systems, read-only binds, masks, writable binds.
_FRESH, _READ_ONLY, _MASK, _WRITABLE = range(4)


def _absolute(path: Path | str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def _under(path: str, parent: str) -> bool:
    """``path`` is ``parent`` or inside it."""
    return path == parent or parent == "/" or path.startswith(parent + "/")


@dataclass(frozen=True)
class View:
    """The paths of one attempt's view. Read-only and writable paths are absolute (not
    resolved: bound where the agent is told they are); hidden ones any form."""

    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    etc: tuple[str, ...] = ETC_ALLOWLIST


@dataclass
class _Ops:
    ops: list[tuple[int, int, int, list[str]]] = field(default_factory=list)
    remount: list[str] = field(default_factory=list)

    def add(self, dest: str, rank: int, args: list[str]) -> None:
        self.ops.append((_depth(dest), rank, len(self.ops), args))

    def args(self) -> list[str]:
        out: list[str] = []
        for _, _, _, args in sorted(self.ops):
            out += args
        for dest in self.remount:
            out += ["--remount-ro", dest]
        return out


def mount_args(view: View) -> list[str]:
    """bwrap's file system arguments for ``view`` (see the module's docstring). The root
    itself is left writable, for files added after these (the secrets): the caller ends
    with ``--remount-ro /``."""
    ops = _Ops()
    # (where it appears in the sandbox, the host path it shows): every visible bind.
    visible: list[tuple[str, str]] = []

    def bind(source: str, dest: str, rank: int) -> None:
        flag = "--bind" if rank == _WRITABLE else "--ro-bind"
        ops.add(dest, rank, [flag, source, dest])
        visible.append((dest, os.path.realpath(source)))

    bind("/usr", "/usr", _READ_ONLY)
    for path in ROOT_DIRS:
        if os.path.islink(path):
            ops.add(path, _READ_ONLY, ["--symlink", os.readlink(path), path])
        elif os.path.isdir(path):
            bind(path, path, _READ_ONLY)
    for name in view.etc:
        path = f"/etc/{name}"
        if os.path.exists(path):  # a dangling symlink is left out
            bind(path, path, _READ_ONLY)
    ops.add("/proc", _FRESH, ["--proc", "/proc"])
    ops.add("/dev", _FRESH, ["--dev", "/dev"])
    ops.add("/tmp", _FRESH, ["--tmpfs", "/tmp"])
    ops.add(HOME, _FRESH, ["--dir", HOME])

    for path in _distinct(view.read_only):
        real = os.path.realpath(path)
        if not os.path.exists(real):
            continue
        bind(real, path, _READ_ONLY)
        if real != path:  # symlinks into it (a venv's python) resolve to the real path
            bind(real, real, _READ_ONLY)
    for path in _distinct(view.writable):
        bind(os.path.realpath(path), path, _WRITABLE)

    masked: set[str] = set()
    for hidden in _distinct(view.hidden):
        real = os.path.realpath(hidden)
        if not os.path.lexists(real):
            continue
        for dest, source in list(visible):
            if not _under(real, source):
                continue
            inside = dest if real == source else os.path.join(dest, os.path.relpath(real, source))
            if inside in masked:
                continue
            masked.add(inside)
            if os.path.isdir(real):
                ops.add(inside, _MASK, ["--tmpfs", inside])
                ops.remount.append(inside)  # after whatever is bound inside it
            else:
                ops.add(inside, _MASK, ["--ro-bind", "/dev/null", inside])
    return ops.args()


def _distinct(paths: Iterable[str | Path]) -> list[str]:
    seen: dict[str, None] = {}
    for path in paths:
        seen.setdefault(_absolute(path), None)
    return list(seen)
