"""One writer per folder: a lock file naming its holder, taken over when the holder is dead.

Two runs writing into one folder silently overwrite each other's metrics.json and interleave
their logs, so a run (or a sweep) holds `<folder>/.attngym.lock` while it writes there:

* The lock is an exclusive `flock` on that file, so the kernel releases it when the holder exits,
  however it exits (killed, out of memory): there is no lock a crash can leave held.
* The file names the holder (`pid`, `host`, `since`): a second writer is refused with
  `FolderLocked`, whose one-line message names them and the folder.
* A lock file still naming a holder although nobody holds the lock (its holder died before
  releasing it) is stale: it is taken over, with a warning naming the dead holder.
* `release` empties the file and unlocks it (also at the holder's exit, a Ctrl-C included, so
  only a killed holder leaves a stale name); the file stays, so that a writer that opened it just
  before cannot lock a file that no longer has a name while another creates a new one.
* A file system without `flock` (Lustre mounted without `-o flock`, NFS without its lock
  service) refuses it (ENOLCK, ENOSYS, EOPNOTSUPP): the folder is then used unlocked, with a
  warning that one writer per folder is not enforced there. NFSv4, Lustre with `-o flock`, GPFS
  and local disks lock.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from attngym.fileio import check_target

log = logging.getLogger(__name__)

LOCK_FILE = ".attngym.lock"
# flock's errors on a file system that does not lock files (module docstring).
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class FolderLocked(RuntimeError):
    """Another live process holds the folder's lock."""

    def __init__(self, folder: Path, holder: dict[str, Any]):
        self.folder = folder
        self.holder = holder
        who = (
            f"pid {holder['pid']} on {holder.get('host', '?')} (since {holder.get('since', '?')})"
            if "pid" in holder
            else "another run that is just starting"
        )
        super().__init__(
            f"{folder} is in use by {who}; wait for it to finish or choose another folder"
        )


class FolderLock:
    """The lock of one folder; `with FolderLock(folder):` or acquire()/release()."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        """Take the lock (creating the folder); FolderLocked when a live process holds it.

        Raises:
            FolderLocked: another process holds the lock.
            SymlinkRefused: the lock file or the folder is a symlink.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this FolderLock")
        self.folder.mkdir(parents=True, exist_ok=True)
        check_target(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FolderLocked(self.folder, holder) from None
        except OSError as err:
            if err.errno not in NO_FLOCK:
                os.close(fd)
                raise
            log.warning(
                "%s: its file system does not lock files (flock: %s), so nothing stops another "
                "run writing there too; mount Lustre with -o flock, or run from a file system "
                "that locks",
                self.folder,
                err.strerror,
            )
        stale = _read(fd)
        if stale:
            log.warning(
                "%s: taking over the stale lock of pid %s on %s (since %s): it died holding it",
                self.folder,
                stale.get("pid", "?"),
                stale.get("host", "?"),
                stale.get("since", "?"),
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        atexit.register(self.release)  # a process that exits holding it (Ctrl-C) empties it too
        return self

    def release(self) -> None:
        """Empty the lock file and unlock it (nothing when not held)."""
        if self._fd is None:
            return
        atexit.unregister(self.release)
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict[str, Any]:
    """The holder the lock file names ({} when empty or unreadable)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
