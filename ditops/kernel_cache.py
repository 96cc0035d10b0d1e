"""The JIT disk cache shared by the compiling backends (NVRTC cubins, hiprtc code objects).

``cached_binary(key_parts, compile)`` returns the binary stored under ``key_parts``, or
runs ``compile()`` once (across processes) and stores its result. ``cache_dir()`` names
the folder in use.

The folder is ``DITOPS_CACHE_DIR``, else ``platformdirs.user_cache_dir("ditops")``.
``DITOPS_CACHE_DIR=off`` (any case) turns the disk cache off; an empty value counts as
unset, so a stray ``DITOPS_CACHE_DIR=`` in a shell keeps the default folder rather than
silently recompiling every kernel.

The cache never makes a call fail: a folder that cannot be created or written, or that
other users could have planted a binary in (writable by group or other, or owned by
another uid), is reported once on the ``ditops`` logger and kernels compile in memory for
the rest of the process. An entry is trusted only if it is a regular file (never followed
through a symlink) owned by this user, writable by no one else, and passes its checksum;
any other is reported once and replaced by a fresh compile. Lock files are deleted after use.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import filelock
import platformdirs

__all__ = ["cache_dir", "cached_binary"]

logger = logging.getLogger("ditops")

# An entry is MAGIC, the sha256 hex of the payload and a newline, then the payload. The
# checksum catches what a crash or a full disk leaves behind, and it is why writes need no
# fsync: a torn entry is recompiled, never loaded.
_MAGIC = b"ditops-jit-cache 1\n"
_DIGEST_SIZE = 64 + 1  # hex sha256 and its newline

# Long enough for any real compile by the lock's holder; past it we compile ourselves
# rather than hang behind a stuck process.
_LOCK_TIMEOUT_S = 600.0

_state_lock = threading.Lock()
_usable: set = set()  # folders that passed the checks in this process
_refused: dict = {}  # folder -> why it is not used (warned once)


def cache_dir() -> Optional[Path]:
    """The cache folder in use, or None when the disk cache is off or the folder is refused.

    The first call for a folder creates it (mode 0700) and checks it is private to this user.
    """
    setting = os.environ.get("DITOPS_CACHE_DIR", "").strip()
    if setting.lower() == "off":
        return None
    folder = Path(setting).expanduser() if setting else Path(platformdirs.user_cache_dir("ditops"))
    folder = folder.absolute()
    with _state_lock:
        if folder in _usable:
            return folder
        if folder in _refused:
            return None
        problem = _check_folder(folder)
        if problem is None:
            _usable.add(folder)
            return folder
    _refuse(folder, problem)
    return None


def cached_binary(key_parts: Sequence[str], compile: Callable[[], bytes]) -> bytes:
    """The compiled binary for key_parts (e.g. source hash, compiler version, arch, template args):
    read from the disk cache, or compiled with `compile()` and stored.

    Every input that changes the binary must be among ``key_parts``: the key is all the cache
    knows. Concurrent processes asking for the same missing key compile it once.
    """
    key = _key(key_parts)  # first, so that a bad key fails with the disk cache off too
    folder = cache_dir()
    if folder is None:
        return bytes(compile())
    path = folder / f"{key}.bin"
    payload, _ = _read_entry(path)
    if payload is not None:
        return payload
    lock = filelock.FileLock(folder / f"{key}.lock", timeout=_LOCK_TIMEOUT_S, mode=0o600)
    try:
        lock.acquire()
    except filelock.Timeout:
        logger.warning("ditops: waited %.0f s for the JIT cache lock %s; compiling in memory", _LOCK_TIMEOUT_S, lock.lock_file)
        return bytes(compile())
    except OSError as error:
        _refuse(folder, f"cannot create a lock file in it: {error}")
        return bytes(compile())
    try:
        # Another process may have stored it while we waited for the lock.
        payload, problem = _read_entry(path)
        if payload is not None:
            return payload
        if problem is not None:
            logger.warning("ditops: JIT cache entry %s is %s; recompiling it", path, problem)
        payload = bytes(compile())
        try:
            _write_entry(path, payload)
        except OSError as error:
            _refuse(folder, f"cannot write to it: {error}")
        return payload
    finally:
        _remove_lock_file(lock)
        lock.release()


def _key(key_parts: Sequence[str]) -> str:
    if isinstance(key_parts, str):
        raise TypeError("key_parts must be a sequence of strings, not one string")
    parts = [str(part) for part in key_parts]
    if any("\0" in part for part in parts):
        raise ValueError("key_parts must not contain NUL, which separates them in the key")
    # The format version leads the key so that a new entry format finds no old entries,
    # instead of reporting each one as corrupt.
    return hashlib.sha256("\0".join([_MAGIC.decode().strip(), *parts]).encode()).hexdigest()


def _check_folder(folder: Path) -> Optional[str]:
    """None when folder can hold the cache, else why not."""
    try:
        os.makedirs(folder, mode=0o700)
        # The umask can only take bits away from the mode given to makedirs; chmod sets it exactly.
        os.chmod(folder, 0o700)
    except FileExistsError:
        pass  # a folder the user made is kept as it is, if it passes the checks below
    except OSError as error:
        return f"it cannot be created: {error}"
    try:
        info = os.stat(folder)
    except OSError as error:
        return f"it cannot be read: {error}"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    # Anyone who can write here can plant a binary that then runs on the GPU as this user.
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"it is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write to it (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _refuse(folder: Path, reason: str) -> None:
    """Stop using folder for the rest of the process, with one warning."""
    with _state_lock:
        _usable.discard(folder)
        if folder in _refused:
            return
        _refused[folder] = reason
    logger.warning("ditops: JIT cache folder %s is not used (%s); kernels compile in memory instead", folder, reason)


def _read_entry(path: Path) -> tuple[Optional[bytes], Optional[str]]:
    """(payload, None) for a valid entry, (None, None) when there is none, else (None, what is wrong).

    Only a regular file owned by this user and writable by no one else is trusted, as for the
    folder: the entry is opened without following a symlink (a link could point at a file
    anyone can write) and checked on the opened file itself, so nothing can be swapped in
    between the check and the read. Anything else is reported and replaced by a fresh compile
    (the rename in _write_entry replaces the link or the foreign file, never its target).
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO planted under the entry's name cannot hang us
    except FileNotFoundError:
        return None, None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, "a symbolic link (not followed)"
        return None, f"unreadable ({error})"
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            return None, f"owned by another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None, f"writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
        try:
            data = file.read()
        except OSError as error:
            return None, f"unreadable ({error})"
    header = len(_MAGIC) + _DIGEST_SIZE
    if not data.startswith(_MAGIC) or len(data) < header:
        return None, "truncated or not a ditops cache entry"
    digest, payload = data[len(_MAGIC) : header - 1], data[header:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        return None, "corrupt (checksum mismatch)"
    return payload, None


def _remove_lock_file(lock: filelock.FileLock) -> None:
    """Deletes the lock file while holding it, so that a warm cache holds entries only.

    A process already waiting on the deleted file then gets its lock while a newcomer may lock
    a new file of the same name: both may compile the kernel. That costs a compile, never
    correctness: each reads the entry again under its lock, and entries are written whole by
    rename. The lock only saves duplicate work."""
    try:
        os.unlink(lock.lock_file)
    except OSError:
        pass  # already gone, or the folder turned read-only: a stale lock file is harmless


def _write_entry(path: Path, payload: bytes) -> None:
    # A temp file in the same folder, then a rename: readers see the old entry or the whole
    # new one, never a partial write.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _reset() -> None:
    """Forget which folders were checked or refused (for tests)."""
    with _state_lock:
        _usable.clear()
        _refused.clear()
