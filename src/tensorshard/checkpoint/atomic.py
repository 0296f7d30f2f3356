"""Writes that cannot damage what is already on disk: temporary name, fsync, rename into place.

A file is written under a hidden temporary name in its final directory, flushed to disk, then renamed
over the target with `os.replace` (atomic on POSIX and Windows); the directory is synced so the rename
itself survives a crash. A write that fails or is killed leaves at most a stray temporary file, never a
half-written target. Multi-file checkpoints build on this: their data files get fresh names, and one
index file renamed into place last is the commit point (see sharded.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

TMP_MARK = ".tmp-"


def temp_name(path: Path) -> Path:
    """A hidden sibling of `path` that no other writer picks: ``.model.json.tmp-<pid>-<random>``."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def fsync_dir(directory: Path) -> None:
    """Make renames inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file for writing; on success it replaces `path` in one step.

        with atomic_write("ckpt/tensorshard.json", "w") as f:
            json.dump(index, f)
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def staged_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[tuple[IO, Path]]:
    """Write to a temporary file that stays under its temporary name (the caller publishes it later
    with `publish`). Yields the open file and the temporary path; removes it if the block fails."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, mode) as f:
            yield f, tmp
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def publish(renames: list[tuple[Path, Path]]) -> None:
    """Rename staged files to their final names and sync their directories."""
    for tmp, final in renames:
        os.replace(tmp, final)
    for directory in {final.parent for _, final in renames}:
        fsync_dir(directory)


def write_into_folder(target: Path, write: Callable[[Path], None], replaces: tuple[str, ...] = ()) -> None:
    """Let `write` fill a fresh temporary folder next to `target`, then move its files into `target`.

    Files of `target` matching a glob of `replaces` that the new write did not produce are removed first
    (the shards of an earlier, larger save). A `write` that fails leaves `target` as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_MARK}", dir=target.parent))
    try:
        write(tmp)
        target.mkdir(exist_ok=True)
        written = {p.name for p in tmp.iterdir()}
        for pattern in replaces:
            for stale in target.glob(pattern):
                if stale.name not in written:
                    stale.unlink()
        for path in tmp.iterdir():
            os.replace(path, target / path.name)
        fsync_dir(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
