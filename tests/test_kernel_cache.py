"""The JIT disk cache (ditops.kernel_cache): hits, keys, concurrent processes, damaged
entries, entries it must not trust (symlinks, other owners, writable by others, not files),
folders it must not use, and no lock files left behind. CPU only."""

import hashlib
import logging
import multiprocessing
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import platformdirs
import pytest

from ditops import kernel_cache

PAYLOAD = bytes(range(256)) * 16  # every byte value, so no text-mode mangling goes unseen
NOBODY = 65534  # the uid the root-run tests drop to: permission bits bind it


@pytest.fixture(autouse=True)
def cache_folder(monkeypatch, tmp_path):
    """Each test gets its own cache folder and a process that has warned about nothing."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(folder))
    kernel_cache._reset()
    yield folder
    kernel_cache._reset()


@pytest.fixture
def warnings_(caplog):
    """The WARNING records of the ditops logger, as a live list."""
    caplog.set_level(logging.WARNING, logger="ditops")

    class Records:
        def __call__(self):
            return [r.getMessage() for r in caplog.records if r.name == "ditops" and r.levelno >= logging.WARNING]

    return Records()


class Compiler:
    """A compile function that counts its runs."""

    def __init__(self, payload=PAYLOAD):
        self.payload = payload
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.payload


def entries(folder):
    return sorted(folder.glob("*.bin"))


def assert_valid_entry(path, payload):
    data = path.read_bytes()
    assert kernel_cache._read_entry(path) == (payload, None)
    assert data.endswith(payload) and hashlib.sha256(payload).hexdigest().encode() in data


def test_second_call_is_a_hit(cache_folder, warnings_):
    compiler = Compiler()
    assert kernel_cache.cached_binary(["src", "sm_90"], compiler) == PAYLOAD
    assert compiler.calls == 1
    assert kernel_cache.cached_binary(["src", "sm_90"], compiler) == PAYLOAD
    assert compiler.calls == 1

    assert kernel_cache.cache_dir() == cache_folder
    assert stat.S_IMODE(cache_folder.stat().st_mode) == 0o700
    (entry,) = entries(cache_folder)
    assert_valid_entry(entry, PAYLOAD)
    assert not list(cache_folder.glob("*.tmp"))
    # A fresh process (forgotten state) reads the same entry from disk.
    kernel_cache._reset()
    assert kernel_cache.cached_binary(["src", "sm_90"], compiler) == PAYLOAD
    assert compiler.calls == 1
    assert warnings_() == []


def test_key_parts_matter(cache_folder):
    keys = [["src", "sm_80"], ["src", "sm_90"], ["src2", "sm_90"], ["srcsm_90"], ["src", "sm_90", ""]]
    compilers = [Compiler(f"binary {i}".encode()) for i in range(len(keys))]
    for key, compiler in zip(keys, compilers):
        assert kernel_cache.cached_binary(key, compiler) == compiler.payload
    assert len(entries(cache_folder)) == len(keys)
    for key, compiler in zip(keys, compilers):
        assert kernel_cache.cached_binary(key, compiler) == compiler.payload
        assert compiler.calls == 1


def test_bad_keys_are_refused():
    with pytest.raises(ValueError):
        kernel_cache.cached_binary(["a\0b"], Compiler())
    with pytest.raises(TypeError):
        kernel_cache.cached_binary("src", Compiler())


def test_off_disables_the_disk_cache(monkeypatch, cache_folder, warnings_):
    monkeypatch.setenv("DITOPS_CACHE_DIR", "OFF")
    compiler = Compiler()
    for _ in range(2):
        assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2
    assert kernel_cache.cache_dir() is None
    assert not cache_folder.exists()
    assert warnings_() == []


def test_empty_setting_means_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("DITOPS_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # keep the real home out of it
    assert kernel_cache.cache_dir() == Path(platformdirs.user_cache_dir("ditops")).absolute()
    assert kernel_cache.cache_dir().is_relative_to(tmp_path)


def _compile_in_child(barrier, log_path, result_queue):
    """One of the racing processes: wait for the other, then ask for the same kernel."""

    def compile():
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # a slow compile, so that the other process arrives while it runs
        return PAYLOAD

    barrier.wait(timeout=120)
    result_queue.put(kernel_cache.cached_binary(["race", "sm_90"], compile))


def test_two_processes_compile_a_kernel_once(cache_folder, tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    log_path = tmp_path / "compiles.log"
    children = [context.Process(target=_compile_in_child, args=(barrier, log_path, results)) for _ in range(2)]
    for child in children:
        child.start()
    outputs = [results.get(timeout=180) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0

    assert outputs == [PAYLOAD, PAYLOAD]
    assert len(log_path.read_text().split()) == 1, "the kernel compiled more than once"
    (entry,) = entries(cache_folder)
    assert_valid_entry(entry, PAYLOAD)
    assert list(cache_folder.iterdir()) == [entry], "lock and temp files must be gone"


DAMAGES = {
    "truncated payload": lambda data: data[: len(data) // 2],
    "truncated header": lambda data: data[:10],
    "empty": lambda data: b"",
    "garbage": lambda data: os.urandom(len(data)),
    "flipped byte": lambda data: data[:-1] + bytes([data[-1] ^ 1]),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_damaged_entry_is_recompiled_and_rewritten(cache_folder, warnings_, damage):
    compiler = Compiler()
    kernel_cache.cached_binary(["src"], compiler)
    (entry,) = entries(cache_folder)
    entry.write_bytes(DAMAGES[damage](entry.read_bytes()))

    assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2
    (warning,) = warnings_()
    assert str(entry) in warning
    assert_valid_entry(entry, PAYLOAD)
    assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2
    assert kernel_cache.cache_dir() == cache_folder  # a bad entry does not retire the folder


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _use_read_only_folder(drop_to_uid, result_queue):
    """In a child process, so that root can drop to a uid the permission bits bind."""
    if drop_to_uid is not None:
        os.setgroups([])
        os.setgid(drop_to_uid)
        os.setuid(drop_to_uid)
    handler = _ListHandler()
    logging.getLogger("ditops").addHandler(handler)
    compiler = Compiler()
    try:
        outputs = [kernel_cache.cached_binary(key, compiler) for key in (["a"], ["b"], ["a"])]
        result_queue.put((outputs, compiler.calls, handler.messages, kernel_cache.cache_dir(), None))
    except BaseException as error:  # the test must see it, not a timeout
        result_queue.put((None, compiler.calls, handler.messages, None, repr(error)))


def test_read_only_folder_compiles_in_memory(monkeypatch, tmp_path):
    if os.geteuid() == 0:
        # Root ignores permission bits, so the child drops to NOBODY, which must be able to
        # reach the folder (pytest's tmp_path lies under a root-only folder) and own it (a
        # folder owned by another uid is refused for that reason instead).
        base = Path(tempfile.mkdtemp(prefix="ditops-read-only-"))
        os.chown(base, NOBODY, NOBODY)
        drop_to_uid = NOBODY
    else:
        base, drop_to_uid = tmp_path, None
    folder = base / "cache"
    folder.mkdir()
    if drop_to_uid is not None:
        os.chown(folder, drop_to_uid, drop_to_uid)
    folder.chmod(0o500)
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(folder))
    try:
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        child = context.Process(target=_use_read_only_folder, args=(drop_to_uid, results))
        child.start()
        outputs, calls, messages, folder_in_use, error = results.get(timeout=180)
        child.join(timeout=60)
        assert error is None and child.exitcode == 0
        assert outputs == [PAYLOAD] * 3
        assert calls == 3, "every kernel compiles in memory"
        (message,) = messages
        assert str(folder) in message and ("Errno 13" in message or "Errno 30" in message), message
        assert folder_in_use is None
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)
        if base != tmp_path:
            shutil.rmtree(base)


def test_folder_that_cannot_be_created(monkeypatch, tmp_path, warnings_):
    (tmp_path / "a file").write_bytes(b"")
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(tmp_path / "a file" / "cache"))
    compiler = Compiler()
    for _ in range(2):
        assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2
    (warning,) = warnings_()
    assert "a file" in warning and "cannot be created" in warning
    assert kernel_cache.cache_dir() is None


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_folder_others_can_write_is_not_used(cache_folder, warnings_, mode):
    cache_folder.mkdir()
    cache_folder.chmod(mode)
    compiler = Compiler()
    for key in (["a"], ["a"], ["b"]):
        assert kernel_cache.cached_binary(key, compiler) == PAYLOAD
    assert compiler.calls == 3
    (warning,) = warnings_()
    assert str(cache_folder) in warning and "other users can write" in warning
    assert kernel_cache.cache_dir() is None
    assert list(cache_folder.iterdir()) == []
    assert stat.S_IMODE(cache_folder.stat().st_mode) == mode  # not "repaired" behind the user's back


def test_folder_owned_by_another_user_is_not_used(monkeypatch, cache_folder, warnings_):
    cache_folder.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(cache_folder, NOBODY, NOBODY)
    else:  # cannot give a folder away: become someone else in the eyes of the check
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    compiler = Compiler()
    for _ in range(2):
        assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2
    (warning,) = warnings_()
    assert str(cache_folder) in warning and "owned by another user" in warning
    assert list(cache_folder.iterdir()) == []


# Entries are trusted only as regular files of this user that no one else can write.


def _planted(cache_folder, compiler):
    """Stores one entry, then returns its path for the test to replace."""
    kernel_cache.cached_binary(["src"], compiler)
    (entry,) = entries(cache_folder)
    return entry


def _assert_replaced_once(cache_folder, compiler, warnings_, entry, problem):
    assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2, "the planted entry must not be loaded"
    (warning,) = warnings_()
    assert str(entry) in warning and problem in warning, warning
    assert not entry.is_symlink() and entry.is_file()
    info = entry.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o600
    assert_valid_entry(entry, PAYLOAD)
    assert kernel_cache.cached_binary(["src"], compiler) == PAYLOAD
    assert compiler.calls == 2 and len(warnings_()) == 1
    assert kernel_cache.cache_dir() == cache_folder


def test_symlinked_entry_is_not_followed(cache_folder, tmp_path, warnings_):
    compiler = Compiler()
    entry = _planted(cache_folder, compiler)
    # A well-formed entry with other bytes, in a file anyone can write, outside the folder.
    outside = tmp_path / "planted.bin"
    planted = kernel_cache._MAGIC + hashlib.sha256(b"evil").hexdigest().encode() + b"\n" + b"evil"
    outside.write_bytes(planted)
    outside.chmod(0o666)
    entry.unlink()
    entry.symlink_to(outside)
    _assert_replaced_once(cache_folder, compiler, warnings_, entry, "symbolic link")
    assert outside.read_bytes() == planted, "the link's target must not be written through"


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_entry_others_can_write_is_replaced(cache_folder, warnings_, mode):
    compiler = Compiler()
    entry = _planted(cache_folder, compiler)
    entry.chmod(mode)
    _assert_replaced_once(cache_folder, compiler, warnings_, entry, "writable by other users")


def test_entry_owned_by_another_user_is_replaced(cache_folder, warnings_):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    compiler = Compiler()
    entry = _planted(cache_folder, compiler)
    os.chown(entry, NOBODY, NOBODY)
    _assert_replaced_once(cache_folder, compiler, warnings_, entry, "owned by another user")


def test_entry_that_is_not_a_regular_file_is_replaced(cache_folder, warnings_):
    compiler = Compiler()
    entry = _planted(cache_folder, compiler)
    entry.unlink()
    os.mkfifo(entry, 0o600)  # opening a FIFO for reading would block without O_NONBLOCK
    _assert_replaced_once(cache_folder, compiler, warnings_, entry, "not a regular file")


def test_no_lock_or_temp_files_are_left(cache_folder):
    compiler = Compiler()
    for index in range(24):
        kernel_cache.cached_binary(["src", str(index)], compiler)
    assert compiler.calls == 24
    assert sorted(path.suffix for path in cache_folder.iterdir()) == [".bin"] * 24
