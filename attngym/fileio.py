"""Writes that stay inside the run folder: no write through a symlink, no half-written file.

A run or sweep folder may hold things nobody expected: a symlink planted where `heatmap.png` or
`summary.csv` goes would make a plain `open(path, "w")` overwrite a file outside the folder. Every
writer of a run folder (metrics.json, results.md, the pictures, the sweep summary, report.html,
the lock file) goes through this module instead:

    atomic_write(path, data)   the whole content to a temporary file beside `path`, then
                               os.replace: a reader sees the old file or the new one, never half;
                               the temporary file is removed if anything fails.

It refuses, with `SymlinkRefused` naming the path, when `path` or the folder holding it is a
symlink (a folder further up, e.g. `outputs -> /scratch/outputs`, is the user's choice and is
followed). `remove_stale_tmps` removes the temporary files a killed writer left behind.

Reads of what a run or sweep folder holds (metrics.json, overrides.yaml, grid.json, the pictures
report.html embeds) follow the mirror rule, since a folder may come from someone else:

    read_inside(root, relative, limit)   the bytes of a regular file under `root`, reached
                                         through no symlink, at most `limit` bytes; else
                                         `ReadRefused` saying why (a symlink, a FIFO or device,
                                         too large). It never blocks on a FIFO.

Library module: standard library only, usable from viz and report as from tracking.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from pathlib import Path

# The first bytes of every PNG file (a picture read back is checked for them).
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class SymlinkRefused(PermissionError):
    """A write whose target or target folder is a symlink (it could point outside the folder)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        link = self.path if self.path.is_symlink() else self.path.parent
        target = os.readlink(link) if link.is_symlink() else "?"
        self.reason = (
            f"{link} is a symlink (to {target}); writes stay inside the run folder, remove the link"
        )
        super().__init__(f"refusing to write {self.path}: {self.reason}")


def write_error(err: OSError) -> str:
    """`could not write <path>: <reason>`: one line for a failed write (SymlinkRefused, or an
    OSError from atomic_write, which names the file it was writing)."""
    if isinstance(err, SymlinkRefused):
        return f"could not write {err.path}: {err.reason}"
    where = err.filename or "to its output (its reader, a terminal or a job, went away)"
    return f"could not write {where}: {err.strerror or err}"


def check_target(path: str | os.PathLike) -> Path:
    """`path` as a Path; SymlinkRefused when it or the folder holding it is a symlink."""
    path = Path(path)
    if path.is_symlink() or path.parent.is_symlink():
        raise SymlinkRefused(path)
    return path


def tmp_name(path: Path, pid: int | None = None) -> Path:
    """The temporary file beside `path` that process `pid` (default: this one) writes first."""
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}.tmp")


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` through a temporary file and os.replace; see the module docstring.

    Raises:
        SymlinkRefused: `path` or its folder is a symlink.
        OSError: the write failed (ENOSPC, ...), its filename `path` (not the temporary's);
            `path` is left as it was, no temporary remains.
    """
    path = check_target(path)
    tmp = tmp_name(path)
    raw = data.encode() if isinstance(data, str) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err  # the same OSError subclass
        raise
    return path


_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmps(folder: str | os.PathLike) -> list[Path]:
    """Remove the `.<name>.<pid>.tmp` files in `folder` whose writer is no longer alive."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in Path(folder).iterdir():
            m = _TMP.match(entry.name)
            if m and not entry.is_symlink() and not pid_alive(int(m["pid"])):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry)
    return removed


class ReadRefused(OSError):
    """A file of a run or sweep folder that is not read: `reason` says why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(errno.EPERM, reason, str(path))

    def __str__(self) -> str:
        return f"skipped {self.path}: {self.reason}"


def read_inside(
    root: str | os.PathLike, relative: str | os.PathLike, limit: int, *, one_link: bool = False
) -> bytes:
    """The bytes of root/relative: a regular file of at most `limit` bytes, reached from `root`
    through no symlink (each folder opened with O_NOFOLLOW, then the file with O_NONBLOCK, so a
    FIFO cannot block the read); with `one_link`, a file no other name links to (a hard link
    reaches a file outside the folder as a symlink does, and fstat sees it on the file opened).

    Raises:
        FileNotFoundError: it does not exist.
        ReadRefused: a symlink on the way, not a regular file, larger than `limit`, a hard link
            (`one_link`), or any other error reading it (its reason).
    """
    path = Path(root) / relative
    parts = Path(relative).parts
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = nofollow | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                fds.append(os.open(part, flags, dir_fd=fds[-1]))
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(
                    os.path.join(root, *parts[: i + 1])
                ):
                    where = "it is" if last else f"its folder {Path(*parts[: i + 1])} is"
                    raise ReadRefused(path, f"{where} a symlink") from None
                if isinstance(err, FileNotFoundError):
                    raise FileNotFoundError(err.errno, err.strerror, str(path)) from None
                raise ReadRefused(path, err.strerror or str(err)) from None
        info = os.fstat(fds[-1])
        if not stat.S_ISREG(info.st_mode):
            raise ReadRefused(path, "not a regular file (a FIFO, socket or device)")
        if info.st_size > limit:
            raise ReadRefused(path, f"{info.st_size} bytes, more than the {limit} a real one has")
        if one_link and info.st_nlink > 1:
            raise ReadRefused(path, f"{info.st_nlink} names link to it (a hard link)")
        data = os.read(fds[-1], limit + 1)
        while len(data) <= limit and (more := os.read(fds[-1], limit + 1 - len(data))):
            data += more
        if len(data) > limit:
            raise ReadRefused(path, f"more than the {limit} bytes a real one has")
        return data
    except OSError as err:
        if isinstance(err, ReadRefused | FileNotFoundError):
            raise
        raise ReadRefused(path, err.strerror or str(err)) from None  # an I/O error, a bad root
    finally:
        for fd in fds:
            os.close(fd)


def regular_size(path: str | os.PathLike) -> int | None:
    """The size of a regular file that is no symlink; None for anything else or nothing."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def log_file(path: str | os.PathLike) -> logging.FileHandler:
    """A logging handler appending to `path` (a rank's log), refused like a write
    (SymlinkRefused) when `path` or its folder is a symlink."""
    return logging.FileHandler(check_target(path))
