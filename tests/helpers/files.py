"""Filesystem helpers for the safety tests: a flipped bit in a file (damage a checksum finds and a loader
might not), and a small tmpfs mounted for a block (a disk that fills up)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path


def flip_byte(file: Path) -> None:
    """One bit of `file`'s middle byte flipped: damage a checksum finds and a loader might not."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str):
    """A tmpfs of `size` (e.g. "6m") mounted at the existing `folder` for the block, then unmounted; the test is
    skipped where mounting is not allowed."""
    import pytest

    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
