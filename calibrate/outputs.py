"""Where fllama writes its outputs: checked before any long work, written under a temporary name beside the
target and renamed into place; temporaries that a killed run left behind are cleaned up by the next run.

A temporary is named `.NAME.fllama-<host>-<pid>-<random>.tmp`, so a later run knows it as fllama's own and can
tell whether the process that made it is still running (on this host).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from enum import Enum
from pathlib import Path

from model_zoo.errors import FllamaError

TAG = "fllama"
_OURS = re.compile(rf"^\.(?P<name>.+)\.{TAG}-(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-(?P<rest>.+)\.tmp$")
# what fllama 0.1 named its temporaries and the checkpoint --force moved aside (no owner in the name): reported
_LEGACY = re.compile(r"^\.(?P<name>.+)\.(?:[a-z0-9_]{8}\.tmp|old)$")
CHECKPOINT_MARKERS = ("config.json", "fllama_meta.json")


class OutputKind(str, Enum):
    FILE = "file"  # e.g. a stats file
    CHECKPOINT = "checkpoint"  # a directory


def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def temp_prefix(target: Path, pid: int | None = None) -> str:
    """mkdtemp / mkstemp prefix of a temporary for `target` (suffix ".tmp"), made by this process unless `pid`."""
    return f".{target.name}.{TAG}-{_host()}-{os.getpid() if pid is None else pid}-"


def set_ordinary_mode(path: Path) -> None:
    """mkstemp, mkdtemp and safetensors make files private (0600); an output is an ordinary file (0644 under the
    usual umask), readable by whoever may read the directory."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def prepare_output(target: str | os.PathLike, kind: OutputKind, force: bool = False) -> list[str]:
    """FllamaError now, not after the work, if `target` cannot be written: an existing output without --force,
    something else in its place, a directory that cannot be written. Cleans up stale temporaries beside it and
    returns what it did or found, one note each."""
    target = Path(target)
    if target.name in ("", ".", ".."):
        raise FllamaError(f"give the output a name of its own, not {str(target)!r}")
    if target.exists() or target.is_symlink():
        check_replaceable(target, kind, force)
    parent = _nearest_dir(target.parent)
    _probe_writable(parent, target)
    return clean_stale(parent)


def check_free_space(target: str | os.PathLike, need_bytes: int) -> None:
    """FllamaError if the file system that will hold `target` has less than need_bytes free."""
    parent = _nearest_dir(Path(target).parent)
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise FllamaError(f"{target} needs about {need_bytes / 2**20:,.0f} MiB but {parent} has only "
                          f"{free / 2**20:,.0f} MiB free")


def check_replaceable(target: Path, kind: OutputKind, force: bool) -> None:
    if not force:
        raise FllamaError(f"{target} already exists; use --force to replace it")
    if kind == OutputKind.FILE and target.is_dir():
        raise FllamaError(f"{target} is a directory; give a file path")
    if kind == OutputKind.CHECKPOINT:
        if not target.is_dir() or target.is_symlink():
            raise FllamaError(f"{target} exists and is not a directory; --force replaces only a checkpoint directory")
        if any(target.iterdir()) and not any((target / m).is_file() for m in CHECKPOINT_MARKERS):
            raise FllamaError(f"{target} is a directory that holds no checkpoint (no config.json); --force replaces "
                              "only a checkpoint: give another -o")


def _nearest_dir(path: Path) -> Path:
    """`path` or its nearest existing ancestor (the output's missing parents are made when it is written)."""
    p = path if str(path) else Path(".")
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        raise FllamaError(f"{p} is not a directory: the output cannot go under it")
    return p


def _probe_writable(parent: Path, target: Path) -> None:
    """Create and remove a file: the one test that also catches read-only and pseudo file systems."""
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=temp_prefix(target) + "probe-", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FllamaError(f"cannot write in {parent} ({e.strerror or e}): choose another output path") from None


def clean_stale(directory: Path) -> list[str]:
    """Remove the temporaries of fllama runs on this host that are no longer running; a checkpoint moved aside
    by an interrupted --force is put back if its place is still empty. Older, unowned ones are reported."""
    notes = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return notes
    for entry in entries:
        m = _OURS.match(entry.name)
        if m and m["host"] == _host() and not _running(int(m["pid"])):
            notes.append(_clean(entry, directory / m["name"], aside=m["rest"] == "old"))
        elif not m and (legacy := _LEGACY.match(entry.name)) and _looks_like_ours(entry, legacy["name"]):
            notes.append(f"{entry} looks like the temporary of an interrupted fllama run; remove it if no fllama "
                         "is writing there")
    return notes


def _clean(entry: Path, target: Path, aside: bool) -> str:
    if aside and not target.exists():
        os.replace(entry, target)
        return f"restored {target}, moved aside by an interrupted --force run"
    size = _size(entry)
    if entry.is_dir():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
    return f"removed {entry} ({size / 2**20:,.1f} MiB), left by an interrupted fllama run"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _looks_like_ours(entry: Path, name: str) -> bool:
    if entry.is_dir():
        return any((entry / m).exists() for m in (*CHECKPOINT_MARKERS, "model.safetensors"))
    return name.endswith(".safetensors")


def _size(entry: Path) -> int:
    if entry.is_file():
        return entry.stat().st_size
    return sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
