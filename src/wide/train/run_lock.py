"""One writer per run folder: an exclusive lock on ``<out>/.wide-lock``, taken before the model loads.

The lock is ``fcntl.flock`` on that file, which records its holder (pid, host, start time) for the error
message of a second run. The kernel drops a flock when its process ends, however it ends (kill -9
included), so a lock file left by a dead run is stale by construction: the next run takes it over, and the
recorded pid only names the holder. The file is removed on release. Locks are re-entrant within a
process (`wide calibrate` takes it before loading the model, `calibrate()` again around training).
See docs/training.md, "Run folders".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LOCK_NAME = ".wide-lock"


class RunLockedError(ValueError):
    """Another process holds the run folder's lock."""


@dataclass
class _Held:
    fd: int
    path: Path
    created: list[Path] = field(default_factory=list)  # folders the lock created, innermost last
    depth: int = 1


_HELD: dict[Path, _Held] = {}  # resolved run folder -> this process's lock on it


def _holder(path: Path) -> str:
    """Who holds the lock at path, as its file records it."""
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']}, since {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def _acquire(out: Path) -> _Held:
    from wide.model.checkpoint import file_mode

    created = []
    for d in reversed([out, *out.parents]):
        if not d.exists():
            d.mkdir(exist_ok=True)
            created.append(d)
    path = out / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunLockedError(
                    f"--out {out} is in use by another wide run ({_holder(path)}): wait for it to end, "
                    "or choose another --out"
                ) from None
            raise ValueError(f"--out {out}: cannot lock {path} ({e.strerror}); use a local folder") from None
        # the holder before us removes the file on release: a lock on a file no longer at path locks nothing
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(record) + "\n").encode())
    return _Held(fd, path, created)


def _release(held: _Held) -> None:
    with contextlib.suppress(FileNotFoundError):
        held.path.unlink()  # while still locked: a waiter's inode check then sees it go
    os.close(held.fd)
    for d in reversed(held.created):  # a run that failed before writing leaves no empty folder behind
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def run_lock(out: str | Path) -> Iterator[Path]:
    """Hold the exclusive lock of run folder ``out`` (created, with its parents, if missing; the folders
    created are removed again on release when left empty). A second process gets a one-line
    RunLockedError naming the holder; the same process may nest the lock."""
    out = Path(out)
    key = out.resolve()
    held = _HELD.get(key)
    if held is not None:
        held.depth += 1
    else:
        held = _HELD[key] = _acquire(out)
    try:
        yield out / LOCK_NAME
    finally:
        held.depth -= 1
        if held.depth == 0:
            del _HELD[key]
            _release(held)
