"""Files other runs read back: written whole or not at all, and a damaged one set aside, not fatal."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import platform
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.core import console
from tasks.core.errors import InputError, start_of


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename.

    A crash or a full disk leaves the old file (or none), never a truncated one that breaks every later
    run; the temporary file is removed on failure.
    """
    # a name no other writer has (a file system's longest names leave room for the rest); O_EXCL: a new file, never
    # one that was there, nor whatever a link of that name points to
    temporary = path.with_name(f".{path.name[:100]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def output_file(path: Path, flag: str, example: str) -> Path:
    """``path`` as a command's output may be: a regular file (``write_atomically`` replaces it whole) or a new name in
    a folder that exists and takes files; else one line (InputError) naming ``flag``, before the command reads or
    writes anything. A folder, a device (``/dev/full``), a FIFO or a socket cannot hold the output, and a symbolic
    link would be replaced by a file (or, written through, replace what it points to). ``example``: a file name to
    suggest in a folder given instead."""
    try:
        found = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        found = None
    except OSError as error:  # a name longer than the file system takes, a folder that cannot be searched
        raise InputError(f"{flag} {start_of(path, 60, count=True)}: {error.strerror}; name a file in a folder you can write") from None
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise InputError(f"{flag} {path} " + _not_a_file(path, found.st_mode, example))
    if not path.parent.is_dir():
        there = "is not a folder" if path.parent.exists() else "does not exist"
        raise InputError(f"{flag} {path}: the folder {path.parent} {there}; create it or name another file")
    try:  # a folder that takes no new file (/proc, read-only): said now, not after the output is made
        descriptor, probe = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise InputError(f"{flag} {path}: cannot write a file in {path.parent} ({error.strerror}); name a file in "
                         "a folder you can write") from None
    os.close(descriptor)
    os.unlink(probe)
    return path


def _not_a_file(path: Path, mode: int, example: str) -> str:
    """What ``path`` is, said where a regular file was expected, and what to give instead."""
    if stat.S_ISLNK(mode):
        return f"is a symbolic link (to {os.readlink(path)}); name the file itself, or a new one"
    if stat.S_ISDIR(mode):
        return f"is a folder; name a file in it, e.g. {path / example}"
    kind = "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "FIFO" if stat.S_ISFIFO(mode) else "socket"
    return f"is a {kind}, not a regular file; name a file"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks: what a cache records of each file to check it when read."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


SAMPLED = 1 << 16  # bytes read at each of a file's start, middle and end by ``sample_digest``


def sample_digest(path: Path) -> str:
    """sha256 of a file's first, middle and last ``SAMPLED`` bytes (all of a small one): a cheap look at its content,
    kept beside its size and modification time by a cache that would not read the whole file again (a model's
    remembered digest), so that a file changed in place with its time set back is told from the one remembered."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for start in sorted({0, max(0, size // 2 - SAMPLED // 2), max(0, size - SAMPLED)}):
            handle.seek(start)
            digest.update(handle.read(SAMPLED))
    return digest.hexdigest()


def read_json(path: Path, what: str) -> dict | None:
    """The JSON object in ``path``; None when it is absent or damaged (then one line on stderr says so)."""
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        found = None
    if not isinstance(found, dict):
        print(f"ppl-audit: warning: {what} {path} is damaged; it is ignored and made again", file=console.err())
        return None
    return found


def prune(folder: Path, max_bytes: int) -> list[Path]:
    """Delete the least recently used files of ``folder`` until it holds at most ``max_bytes``.

    A cache grows with every new corpus, tokenizer and setting; this keeps it to a size. "Used" is the
    modification time, which a cache touches when it reads an entry. Returns what was deleted.
    """
    files = sorted((file for file in folder.iterdir() if file.is_file()), key=lambda file: file.stat().st_mtime)
    total = sum(file.stat().st_size for file in files)
    deleted = []
    for file in files:
        if total <= max_bytes:
            break
        total -= file.stat().st_size
        file.unlink(missing_ok=True)
        deleted.append(file)
    return deleted


def owner_tag() -> str:
    """This process, as ``pid@host``: names what it writes so that a later run can tell whether it died."""
    return f"{os.getpid()}@{platform.node()}"


def died(owner: str) -> bool:
    """Whether the process an ``owner_tag`` names is gone (one on another host is taken as alive)."""
    pid, _, host = owner.partition("@")
    if host != platform.node() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


@contextmanager
def scratch(root: Path) -> Iterator[Path]:
    """A folder for this process under ``root``, removed when done.

    A process killed before it could remove its folder leaves it behind: the folders of processes that
    died are removed first, so litter lasts until the next use at most.
    """
    root.mkdir(parents=True, exist_ok=True)
    for folder in root.iterdir():
        if died(folder.name.rpartition("~")[0]):
            shutil.rmtree(folder, ignore_errors=True)
    # a folder another thread still writes (gptqmodel's offload, on Ctrl-C) cannot always be removed at once, and
    # that error must not take the place of the stop being raised: what is left goes next time, as a killed one's
    with tempfile.TemporaryDirectory(prefix=f"{owner_tag()}~", dir=root, ignore_cleanup_errors=True) as folder:
        yield Path(folder)


def publish(folder: Path, out: Path) -> None:
    """Put the finished ``folder`` at ``out`` (absent or an empty folder) in one rename, so that whoever looks
    at ``out`` finds all of it or nothing: a process stopped halfway leaves no half-made ``out``.

    Raises:
        FileExistsError: ``out`` holds something (another process published first).
    """
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    try:
        os.rename(folder, out)
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{out} is not empty") from None
        raise


def discard(folder: Path) -> None:
    """Take a cache's folder away at once (a rename), then delete it: no reader ever opens half a folder."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{time.time_ns()}")
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def once_per_file_state(maxsize: int):
    """Decorate ``function(path, *args)`` to run once in this process for each state of the file at ``path`` (with
    ``args``), for reads that cost seconds (a GGUF file's header and config). A file's state is what one ``stat``
    says of its content: which file (device, inode), its size, and its modification and change times. The change
    time is the kernel's, set by every write and by ``touch``, so a file rewritten in place or copied over with its
    size and modification time kept (``cp -p``, ``touch -r``) is read again, at no cost beyond the ``stat``. Callers
    that may change what it returns get it as it is: copy it."""
    def decorate(function):
        @functools.lru_cache(maxsize=maxsize)
        def cached(path: str, state: tuple[int, ...], *args):
            return function(Path(path), *args)

        @functools.wraps(function)
        def call(path: Path, *args):
            stat = path.stat()
            return cached(str(path), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns), *args)
        return call
    return decorate
