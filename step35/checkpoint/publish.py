"""Atomic publish: every checkpoint save (file or folder) is written into a temporary sibling and
then switched in by `publish`, so a save killed at any moment leaves either the previous checkpoint
or the new one under the final name, never a mix.

    tmp = partial_path(final)      # .<name>.partial-<token>, same folder => same filesystem
    ... write everything into tmp (and its manifest, last) ...
    publish(tmp, final)

The switch:
- `final` absent, a file replaced by a file, a symlink (a `last` pointer) replaced: one `rename`
  (atomic on POSIX). A single file's sibling manifest (`x.ckpt.manifest.json`) travels with it: the
  old one is removed first, the new one moved in after the file.
- a folder replacing an existing folder (or file/folder mixes): Linux `renameat2(RENAME_EXCHANGE)`
  swaps the two names in one atomic step where the filesystem supports it (ext4, xfs, btrfs, tmpfs);
  the old content, now under the temporary name, is deleted afterwards. Elsewhere (NFS, Lustre,
  macOS) two renames: `final` -> `.<name>.old-<token>`, then `tmp` -> `final`, then delete the old
  one. A kill between those two renames leaves no `final` but an intact `.<name>.old-*`:
  `interrupted_publish(final)` finds it and `restore(final)` renames it back.

Anything a killed save leaves behind matches `.<name>.partial-*` or `.<name>.old-*` and is listed
by `leftovers(folder)` (which also knows the names older step35 versions used). A partial's name
carries its writer's pid and a tag of its host, so that `dead_partials(folder)` can tell the
partials of writers that died on this host (safe to delete) from those of live writers, or of
writers on another host sharing the filesystem, whose pids mean nothing here (never touched).

Modes: what `publish` switches in gets the modes a plain `open()` / `mkdir` give under the process's
umask (files 0644, folders 0755 under 022), whatever its writer used: safetensors and
`tempfile.mkstemp` create their files 0600, `mkdtemp` its folders 0700, which would leave a shared
checkpoint or export unreadable to the rest of a team.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import FILE_MANIFEST_SUFFIX, manifest_path

# Temporary siblings: written by a save in progress (partial) or retired by a folder swap (old).
# The bare `.x.partial` / `.x.old` / `.x.old-<pid>` spellings are those of step35 before this module.
_LEFTOVER = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>partial|old)(-(?P<tag>[0-9A-Za-z-]+))?"
    r"(\.manifest\.json(\.tmp-\d+)?)?$"
)
# The tag of a partial: <pid>-<host tag>-<random>; step35 before host tags wrote <pid>-<random>.
_WRITER = re.compile(r"^(?P<pid>\d+)-(?:(?P<host>[0-9a-f]{8})-)?[0-9a-z]+$")
_RENAME_EXCHANGE = 2  # linux/fs.h
use_exchange = True  # tests switch it off to exercise the two-rename fallback


def host_tag() -> str:
    """8 hex digits naming this host in partial names (a hostname may hold characters a name may not)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def partial_path(final: str | Path) -> Path:
    """The temporary sibling a save of `final` writes into: `.<name>.partial-<pid>-<host tag>-<random>`."""
    final = Path(final)
    return final.with_name(f".{final.name}.partial-{os.getpid()}-{host_tag()}-{uuid.uuid4().hex[:8]}")


def _old_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_path(path: Path) -> None:
    """Delete a file, a symlink (not what it points to) or a folder, whichever `path` is."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names `a` and `b`; False when this OS/filesystem cannot."""
    if not use_exchange:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux / glibc < 2.28
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def publish(tmp: str | Path, final: str | Path) -> None:
    """Switch the finished `tmp` (file, folder or symlink, a sibling of `final`) in under the name `final`."""
    tmp, final = Path(tmp), Path(final)
    if not tmp.exists() and not tmp.is_symlink():
        raise CheckpointError(f"{tmp}: nothing to publish as {final}")
    if tmp.parent.resolve() != final.parent.resolve():
        raise CheckpointError(f"{tmp}: must be a sibling of {final} (a rename is only atomic within a folder)")
    link = tmp.is_symlink()  # e.g. a `last` pointer: replaced by one rename, its target is not ours to sync
    final_is_folder = final.is_dir() and not final.is_symlink()
    if not link and tmp.is_dir():
        _set_mode(tmp, folder_mode())
        for root, folders, files in os.walk(tmp):  # the data must be on disk before the name points at it
            for name in folders:
                _set_mode(Path(root) / name, folder_mode())
            for name in files:
                _set_mode(Path(root) / name, file_mode())
                _fsync_file(Path(root) / name)
        if final.exists() or final.is_symlink():
            _swap(tmp, final)
        else:
            os.rename(tmp, final)
        final.with_name(final.name + FILE_MANIFEST_SUFFIX).unlink(missing_ok=True)  # a replaced file's
    elif not link:
        # A single file and its sibling manifest: the old manifest goes first, so no moment pairs a
        # manifest with the wrong file (a kill in between leaves a file without a manifest:
        # incomplete, never "damaged").
        _set_mode(tmp, file_mode())
        _fsync_file(tmp)
        new_manifest, old_manifest = manifest_path(tmp), final.with_name(final.name + FILE_MANIFEST_SUFFIX)
        if new_manifest.is_file():
            _set_mode(new_manifest, file_mode())
            _fsync_file(new_manifest)
        old_manifest.unlink(missing_ok=True)
        _fsync_dir(final.parent)
        _swap(tmp, final) if final_is_folder else os.replace(tmp, final)
        if new_manifest.is_file():
            os.replace(new_manifest, old_manifest)
    else:
        _swap(tmp, final) if final_is_folder else os.replace(tmp, final)
    _fsync_dir(final.parent)


def _swap(tmp: Path, final: Path) -> None:
    if _exchange(tmp, final):  # tmp now holds the previous checkpoint
        _fsync_dir(final.parent)
        remove_path(tmp)
    else:
        old = _old_path(final)
        os.rename(final, old)
        os.rename(tmp, final)  # a kill before this line: `restore(final)` renames `old` back
        _fsync_dir(final.parent)
        remove_path(old)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only read it
    by setting it, which for a moment would give other threads' new files mode 0666)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def folder_mode() -> int:
    """The mode `mkdir` gives a new folder: 0777 less the umask (0755 under 022)."""
    return 0o777 & ~_umask()


def _set_mode(path: Path, mode: int) -> None:
    """Give `path` `mode` unless it has it; a filesystem that refuses (some FUSE mounts, files of
    another user) keeps what the writer made: a save is never failed over its modes."""
    try:
        if path.stat().st_mode & 0o7777 != mode:
            path.chmod(mode)
    except OSError:
        pass


def leftovers(folder: str | Path) -> list[Path]:
    """Temporary siblings left in `folder` by saves that were killed (partial writes, retired folders)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _LEFTOVER.match(p.name))


def leftover_of(path: str | Path) -> tuple[str, str] | None:
    """(`final` name, 'partial' | 'old') when `path` is a leftover of a save of that name, else None."""
    m = _LEFTOVER.match(Path(path).name)
    return (m.group("name"), m.group("kind")) if m else None


def partial_writer(path: str | Path) -> tuple[int, str | None] | None:
    """(pid, host tag or None) of the save that writes (or wrote) the partial `path`; the host tag is
    None for a partial named by step35 before host tags. None when `path` is no partial or names no pid."""
    m = _LEFTOVER.match(Path(path).name)
    if not m or m.group("kind") != "partial" or not m.group("tag"):
        return None
    writer = _WRITER.match(m.group("tag"))
    return (int(writer.group("pid")), writer.group("host")) if writer else None


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` lives on this host (one of another user counts as alive)."""
    if pid <= 0:
        return True  # 0 / negative would signal process groups: never taken for dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def dead_partials(folder: str | Path) -> tuple[list[Path], list[Path]]:
    """(partials in `folder` whose writer died on this host: safe to delete; partials whose writer
    cannot be told alive or dead: named by step35 before host tags, pid only). Partials of live
    writers, and of writers on another host (a shared filesystem: their pid means nothing here), are
    in neither list."""
    dead, unknown = [], []
    for path in leftovers(folder):
        writer = partial_writer(path)
        if writer is None:
            continue
        pid, host = writer
        if host is None:
            unknown.append(path)
        elif host == host_tag() and pid != os.getpid() and not pid_alive(pid):
            dead.append(path)
    return dead, unknown


def remove_dead_partials(folder: str | Path) -> list[Path]:
    """Delete the partials in `folder` whose writer died on this host (a killed export's full-size
    copy); returns what was deleted."""
    dead, _ = dead_partials(folder)
    for path in dead:
        remove_path(path)
    return dead


def interrupted_publish(final: str | Path) -> Path | None:
    """The previous checkpoint a two-rename publish of `final` moved aside and was killed before
    replacing: only when `final` itself is missing. None when there is nothing to restore."""
    final = Path(final)
    if final.exists() or not final.parent.is_dir():
        return None
    olds = [p for p in leftovers(final.parent) if leftover_of(p) == (final.name, "old")]
    return max(olds, key=lambda p: p.stat().st_mtime) if olds else None


def restore(final: str | Path) -> Path | None:
    """Rename the checkpoint an interrupted publish moved aside back to `final`; returns it (or None)."""
    old = interrupted_publish(final)
    if old is not None:
        os.rename(old, final)
        return Path(final)
    return None


def check_not_interrupted(final: str | Path) -> None:
    """Raise a CheckpointError with the fix when `final` is missing because a publish was killed."""
    old = interrupted_publish(final)
    if old is not None:
        raise CheckpointError(
            f"{final}: not there, but the checkpoint that an interrupted save was replacing "
            f"is intact at {old}; rename it back to {final}"
        )
