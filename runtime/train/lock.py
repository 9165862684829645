"""One `dflash train` per run folder: an exclusive lock on ``OUT/.lock`` held for the whole run.

The lock is ``fcntl.flock`` on the file, so the kernel drops it when its process ends, however
it ends (exit, crash, kill -9): a lock file left behind by a dead run is stale and simply taken
over. The holder writes its pid into the file; a second run on the same folder reads it for its
error message. The file is removed when the holder releases the lock.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from types import TracebackType

from runtime.errors import ConfigError

LOCK_FILE = ".lock"


class RunFolderLock:
    """Exclusive lock on a run folder (created if missing); a context manager.

    Raises (on ``acquire``):
        ConfigError: another live process holds the folder (the message names it and that pid),
            or the lock file cannot be opened.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> RunFolderLock:
        if self._fd is not None:
            return self
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock (dflash's targets are Linux and macOS)
            return self
        self._created = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run folder {self.folder}: {e.strerror or e}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(
                    f"cannot lock the run folder {self.folder} ({self.path}): {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                for _ in range(25):  # the holder writes its pid right after locking
                    if holder is not None:
                        break
                    time.sleep(0.02)
                    holder = _read_pid(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "a process that has not written its pid yet"
                raise ConfigError(
                    f"the run folder {self.folder} is in use by another dflash train ({who}); "
                    "wait for it to finish or choose another --out"
                ) from None
            except OSError as e:  # a filesystem without locks
                os.close(fd)
                raise ConfigError(
                    f"cannot lock the run folder {self.folder} ({self.path}): {e.strerror or e}"
                ) from None
            # the holder before us may have removed the file between our open and our flock: then we
            # hold a lock on a file nobody else can see; lock the one at the path instead
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (and the folder, if this lock created it and it is empty)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: a waiting run then re-checks the path (acquire)
        os.close(self._fd)  # drops the flock
        self._fd = None
        if self._created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only when empty: a run that failed before writing anything

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file (None while it has not yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
