"""What the node agent reads again and again, parsed once and served while the file or directory is unchanged.

The agent looks at every job's ramdisk five times a second and reports once a second; re-reading
and re-parsing every manifest, progress record and the state file each time would be most of what
an idle agent spends. Here a parsed value is kept beside the status of what it was read from and
served while a fresh ``stat`` gives the same ``Key``.

The key is (device, inode, size, mtime, ctime). A replaced file (a new inode), a rewritten one
(size, mtime) and a directory with an entry created, removed or renamed (mtime, ctime) all give a
new key. ctime is in it because anyone may set a file's mtime back (``utimes``) but only the clock
sets ctime. File systems stamp times from a coarse clock (one tick, 1-10 ms, on many kernels and
file systems), so two changes in one tick can leave equal keys: a value whose ctime was within
``RACY_SECONDS`` of the clock when it was read is not kept (git's "racy git" rule), so it is read
again until its file has been quiet for that long.
"""

import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Key = tuple[int, int, int, int, int]

RACY_SECONDS = 1.0
MAX_ENTRIES = 4096  # files or directories per cache; the oldest goes first (a released job's leftovers)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def key_of(status: os.stat_result) -> Key:
    """The identity and version of a file or directory as ``stat`` shows it."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def settled(key: Key, since_ns: int) -> bool:
    """True when the entry last changed ``RACY_SECONDS`` before ``since_ns`` (``time.time_ns()``
    taken before the ``stat`` that gave ``key``): any later change stamps a different ctime."""
    return key[4] < since_ns - int(RACY_SECONDS * 1e9)


class KeyedCache(Generic[T]):
    """path -> (key, value), bounded to ``max_entries`` paths; safe to use from several threads."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self._entries: dict[str, tuple[Key, T]] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, path: str, key: Key | None) -> T | None:
        """The value stored for ``path`` under ``key``, else None."""
        entry = self._entries.get(path)
        return entry[1] if entry is not None and entry[0] == key else None

    def forget(self, path: str) -> None:
        """Forgets ``path``: it is read again next time."""
        with self._lock:
            self._entries.pop(path, None)

    def put(self, path: str, key: Key | None, since_ns: int, value: T) -> None:
        """Stores ``value`` read from ``path`` as ``key`` describes it, if that is settled (see
        ``settled``); otherwise (or with no key: it is gone) forgets the path, so it is read again."""
        with self._lock:
            self._entries.pop(path, None)
            if key is not None and settled(key, since_ns):
                _bound(self._entries, self._max)
                self._entries[path] = (key, value)


def _read(path: str, parse: Callable[[bytes], T], since_ns: int) -> tuple[Key | None, T] | None:
    """(key, value) of ``path``, the key None when not settled; None when it does not exist."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(fd)  # the key of exactly what is read
        value = parse(f.read())
    key = key_of(status)
    return (key if settled(key, since_ns) else None), value


class FileCache(Generic[T]):
    """Files the agent owns, each parsed once per version.

    Args:
      parse: bytes of the file -> value; what it raises reaches the caller, and nothing is stored.
    """

    def __init__(self, parse: Callable[[bytes], T], max_entries: int = MAX_ENTRIES):
        self._parse = parse
        self._cache: KeyedCache[T] = KeyedCache(max_entries)

    def read(self, path: str) -> T | None:
        """The parsed content of ``path`` (shared: do not mutate it), or None when it does not exist.

        Raises:
          OSError: it cannot be read (a symlink at its last component is refused, ELOOP).
        """
        since = time.time_ns()
        try:
            key = key_of(os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            key = None
        cached = self._cache.get(path, key)
        if cached is not None:
            return cached
        found = _read(path, self._parse, since) if key is not None else None
        if found is None:
            self._cache.forget(path)
            return None
        self._cache.put(path, found[0], since, found[1])
        return found[1]


class DirCache(Generic[T]):
    """The wanted files of directories the agent owns, each parsed once per version: a call lists
    the directory and ``stat``s each wanted file.

    Args:
      wanted: which names of a directory to read.
      parse: bytes of a file -> value.
    """

    def __init__(self, wanted: Callable[[str], object], parse: Callable[[bytes], T], max_entries: int = MAX_ENTRIES):
        self._wanted = wanted
        self._parse = parse
        # directory -> name -> (key, None when not settled; value): exactly the files of the last listing
        self._listings: dict[str, dict[str, tuple[Key | None, T]]] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def read(self, directory: str) -> dict[str, T]:
        """name -> parsed value of each wanted file in ``directory`` (a new dict; the values are
        shared: do not mutate them).

        Raises:
          FileNotFoundError: the directory does not exist.
        """
        since = time.time_ns()
        before = self._listings.get(directory, {})
        found: dict[str, tuple[Key | None, T]] = {}
        for name in os.listdir(directory):
            if not self._wanted(name):
                continue
            path = os.path.join(directory, name)
            try:
                key = key_of(os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                continue
            if (old := before.get(name)) is not None and old[0] == key:
                found[name] = old
            elif (read := _read(path, self._parse, since)) is not None:
                found[name] = read
        with self._lock:
            self._listings.pop(directory, None)
            _bound(self._listings, self._max)
            self._listings[directory] = found
        return {name: value for name, (_, value) in found.items()}


def _bound(entries: dict, max_entries: int) -> None:
    """Makes room for one more entry: the oldest goes (a released job's leftovers, in practice)."""
    while len(entries) >= max_entries:
        del entries[next(iter(entries))]
