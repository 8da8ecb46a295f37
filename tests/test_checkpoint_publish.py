"""`publish` (the one atomic switch every save uses) and the manifest it publishes with: every
interrupted state is either the old checkpoint, the new one, or a named, recoverable leftover."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from step35.checkpoint import publish as pub
from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.integrity import (
    ManifestMissing,
    damage_record,
    is_complete,
    manifest_info,
    manifest_path,
    verify,
    verify_for_load,
    write_manifest,
)


def folder_checkpoint(final: Path, content: str, step: int) -> Path:
    tmp = pub.partial_path(final)
    tmp.mkdir()
    (tmp / "shard.bin").write_text(content)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "meta").write_text(content * 2)
    write_manifest(tmp, {"global_step": step})
    return tmp


def file_checkpoint(final: Path, content: str, step: int) -> Path:
    tmp = pub.partial_path(final)
    tmp.write_text(content)
    write_manifest(tmp, {"global_step": step})
    return tmp


@pytest.fixture(params=["exchange", "two-renames"])
def mode(request, monkeypatch):
    monkeypatch.setattr(pub, "use_exchange", request.param == "exchange")
    return request.param


def test_partial_path_is_a_hidden_sibling_listed_as_leftover(tmp_path):
    tmp = pub.partial_path(tmp_path / "step=4.ckpt")
    assert tmp.parent == tmp_path and tmp.name.startswith(".step=4.ckpt.partial-")
    assert pub.partial_path(tmp_path / "x") != pub.partial_path(tmp_path / "x")
    tmp.mkdir()
    (tmp_path / "step=4.ckpt").mkdir()
    assert pub.leftovers(tmp_path) == [tmp]
    assert pub.leftover_of(tmp) == ("step=4.ckpt", "partial")


def test_folder_replaces_folder(tmp_path, mode):
    final = tmp_path / "last.ckpt"
    pub.publish(folder_checkpoint(final, "one", 1), final)
    assert manifest_info(final)["extra"]["global_step"] == 1
    pub.publish(folder_checkpoint(final, "two", 2), final)
    assert (final / "shard.bin").read_text() == "two" and verify(final)["extra"]["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left over


def test_file_replaces_file_with_its_manifest(tmp_path, mode):
    final = tmp_path / "last.ckpt"
    pub.publish(file_checkpoint(final, "one", 1), final)
    pub.publish(file_checkpoint(final, "two", 2), final)
    assert final.read_text() == "two" and verify(final)["extra"]["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.manifest.json"]


def test_file_and_folder_replace_each_other(tmp_path, mode):
    final = tmp_path / "last.ckpt"
    pub.publish(folder_checkpoint(final, "one", 1), final)
    pub.publish(file_checkpoint(final, "two", 2), final)
    assert final.is_file() and verify(final)["extra"]["global_step"] == 2
    pub.publish(folder_checkpoint(final, "three", 3), final)
    assert final.is_dir() and verify(final)["extra"]["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the file's manifest went with it


def test_kill_between_the_two_renames_is_recoverable(tmp_path, monkeypatch):
    """Where no atomic exchange exists, a kill after `final` was moved aside leaves it intact under
    `.final.old-*`: loaders say so, `restore` puts it back."""
    monkeypatch.setattr(pub, "use_exchange", False)
    final = tmp_path / "last.ckpt"
    pub.publish(folder_checkpoint(final, "one", 1), final)
    real_rename, calls = os.rename, []

    def killed_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(folder_checkpoint(final, "two", 2), final)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not final.exists()
    with pytest.raises(CheckpointError, match=r"intact at .*\.last\.ckpt\.old-.*rename it back"):
        pub.check_not_interrupted(final)
    assert {pub.leftover_of(p)[1] for p in pub.leftovers(tmp_path)} == {"old", "partial"}
    assert pub.restore(final) == final
    assert verify(final)["extra"]["global_step"] == 1 and (final / "shard.bin").read_text() == "one"


def test_kill_between_manifest_and_file_leaves_an_incomplete_file_not_a_damaged_one(tmp_path, monkeypatch):
    """Single file: the old manifest goes first, so a kill never pairs a manifest with the wrong file."""
    final = tmp_path / "last.ckpt"
    pub.publish(file_checkpoint(final, "one", 1), final)
    real_replace = os.replace

    def killed(src, dst):
        raise KeyboardInterrupt("killed")

    tmp = file_checkpoint(final, "two", 2)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(tmp, final)
    monkeypatch.setattr(os, "replace", real_replace)
    assert final.read_text() == "one" and not is_complete(final)
    with pytest.raises(ManifestMissing):
        verify(final)
    with pytest.warns(UserWarning, match="no step35 manifest"):
        assert verify_for_load(final) is None


def test_publish_refuses_a_tmp_elsewhere(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tmp = folder_checkpoint(tmp_path / "a" / "x", "one", 1)
    with pytest.raises(CheckpointError, match="sibling"):
        pub.publish(tmp, tmp_path / "b" / "x")


def test_verify_names_missing_truncated_and_damaged_files(tmp_path):
    final = tmp_path / "ckpt"
    pub.publish(folder_checkpoint(final, "0123456789", 1), final)
    (final / "sub" / "meta").write_text("01234567890123456789"[::-1])  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"sub/meta: checksum mismatch .*damaged \(recorded in \.ckpt\.damaged"):
        verify(final)
    # Recorded: a size-only check (how --ckpt_path last|auto choose) now refuses it too, naming the record.
    with pytest.raises(
        CheckpointError, match=r"sub/meta: checksum mismatch .*found by an earlier load; delete .*\.ckpt\.damaged"
    ):
        verify(final, sizes_only=True)
    damage_record(final).unlink()
    (final / "sub" / "meta").write_text("short")
    with pytest.raises(CheckpointError, match=r"sub/meta: 5 bytes, the manifest says 20: truncated"):
        verify(final)
    (final / "shard.bin").unlink()
    with pytest.raises(CheckpointError, match=r"shard.bin: missing"):
        verify(final)
    manifest_path(final).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step35.manifest.json: unreadable manifest"):
        verify(final)
    assert not is_complete(final)


def test_checksums_split_over_ranks_cover_every_file(tmp_path):
    final = tmp_path / "ckpt"
    pub.publish(folder_checkpoint(final, "abc", 1), final)
    (final / "shard.bin").write_text("abd")
    hits = []
    for rank in range(3):
        try:
            verify(final, rank, 3)
        except CheckpointError as e:
            hits.append((rank, str(e)))
    assert len(hits) == 1 and "shard.bin" in hits[0][1]  # exactly one rank hashes each file


def test_symlink_pointer_is_replaced_in_one_rename(tmp_path, mode):
    """A `last` pointer (symlink) to a checkpoint is switched by one rename; targets are untouched."""
    for step in (1, 2):
        target = tmp_path / f"step={step}.ckpt"
        pub.publish(folder_checkpoint(target, str(step), step), target)
        tmp = pub.partial_path(tmp_path / "last")
        tmp.symlink_to(target.name)
        pub.publish(tmp, tmp_path / "last")
        assert (tmp_path / "last").is_symlink() and verify(tmp_path / "last")["extra"]["global_step"] == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step=1.ckpt", "step=2.ckpt"]
