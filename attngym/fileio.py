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

Library module: standard library only, usable from viz and report as from tracking.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


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
