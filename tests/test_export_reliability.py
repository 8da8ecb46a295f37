"""`step35 export` and the readers of start folders under misuse (issue 42): a file of the start folder (or of a
tokenizer folder) that links out of it is never copied into an export or a checkpoint, a link inside the folder
and a hub cache snapshot's links into its `blobs/` still are.

Before these fixes `LICENSE -> /proc/self/environ` in a start folder published the exporting process's
environment (its API keys) as the export's LICENSE, and a tokenizer file linking out was recorded in every
checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from step35.checkpoint.training import run_tokenizer
from step35.cli import main
from step35.data import builtin_tokenizer_dir
from tests.helpers import saved_steps, write_run_config
from tests.runner import cli_fit
from tests.test_export import copied_lines, home_like_folder

MARKER = "step35-leak-marker-5e1f0c"  # in the environment and in a file outside the folder: never exported


def files_holding(folder: Path, marker: str) -> list[str]:
    """The files below `folder` whose bytes hold `marker`."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]


@pytest.fixture
def secret(tmp_path, monkeypatch) -> Path:
    """A file outside every folder exported, holding MARKER (also set in this process's environment)."""
    monkeypatch.setenv("STEP35_TEST_SECRET", MARKER)
    path = tmp_path / "elsewhere" / "credentials"
    path.parent.mkdir()
    path.write_text(f"token={MARKER}\n")
    return path


# ------------------------------------------------------------------------------ 1. links out of the start folder
def test_an_export_never_follows_a_link_out_of_its_source_folder(tiny_run, tmp_path, builtin_cache, secret, capsys):
    source = tmp_path / "release"
    home_like_folder(source, builtin_tokenizer_dir(cache_dir=builtin_cache))
    (source / "LICENSE").unlink()
    (source / "LICENSE").symlink_to("/proc/self/environ")
    (source / "NOTICE").symlink_to(secret)
    (source / "docs").mkdir()
    (source / "docs" / "card.md").write_bytes(b"# the card, kept in docs/\n")
    (source / "README.md").unlink()
    (source / "README.md").symlink_to("docs/card.md")  # a link inside the folder: still copied
    out = tmp_path / "hf"

    main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(out), "--source", str(source)])

    assert files_holding(out, MARKER) == []
    assert not (out / "LICENSE").exists() and not (out / "NOTICE").exists()
    assert (out / "README.md").read_bytes() == b"# the card, kept in docs/\n"
    said = capsys.readouterr()
    assert "LICENSE" not in copied_lines(said.out) and "NOTICE" not in copied_lines(said.out)
    left = [line for line in said.err.splitlines() if "a link out of the folder" in line]
    assert len(left) == 1, said.err
    assert f"left out of {source}: LICENSE -> /proc/" in left[0] and f"NOTICE -> {secret}" in left[0], left


def test_a_hub_cache_snapshot_is_exported_through_its_links_into_blobs(tiny_run, tmp_path, builtin_cache, capsys):
    """In `models--org--name/snapshots/<rev>/` every file is a link to `../../blobs/<hash>`: the cache's own layout,
    exported as the index reader reads it (`hf.folder.own_files`, one rule)."""
    repo = tmp_path / "hub" / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    home_like_folder(tmp_path / "plain", builtin_tokenizer_dir(cache_dir=builtin_cache))
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for k, file in enumerate(p for p in sorted((tmp_path / "plain").iterdir()) if p.is_file()):
        shutil.copyfile(file, blobs / f"blob{k}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{k}")
    out = tmp_path / "hf"

    main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(out), "--source", str(snapshot)])

    assert (out / "LICENSE").read_bytes() == b"MIT\n" and (out / "README.md").read_bytes() == b"# my model\n"
    copied = copied_lines(capsys.readouterr().out)
    assert copied["LICENSE"] == str(snapshot / "LICENSE"), copied


def test_a_tokenizer_folder_with_a_file_linking_out_is_refused(tiny_run, tmp_path, builtin_cache, secret):
    """The tokenizer files are recorded in every checkpoint (at the fit's setup, before any step) and published by
    every export: one linking out is refused by name, not left out (that would change the tokenizer)."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(builtin_tokenizer_dir(cache_dir=builtin_cache), tokenizer)
    (tokenizer / "generation_config.json").symlink_to(secret)
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as refusal:
        main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(out), "--tokenizer", str(tokenizer)])
    message = str(refusal.value)
    assert "\n" not in message and MARKER not in message, message
    assert f"{tokenizer / 'generation_config.json'}: a link to {secret}, outside the tokenizer folder" in message
    assert not out.exists()
    with pytest.raises(ValueError, match="generation_config.json: a link to .* refused"):
        run_tokenizer.record(tokenizer, 0)
    (tokenizer / "generation_config.json").unlink()
    (tokenizer / "generation_config.json").symlink_to("tokenizer_config.json")  # inside: fine
    recorded = run_tokenizer.record(tokenizer, 0)["files"]
    assert recorded["generation_config.json"] == (tokenizer / "tokenizer_config.json").read_bytes()


def test_a_fit_with_such_a_tokenizer_folder_is_refused_before_its_first_step(tmp_path, builtin_cache, secret, capfd):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(builtin_tokenizer_dir(cache_dir=builtin_cache), tokenizer)
    (tokenizer / "added_tokens.json").symlink_to("/proc/self/environ")
    run = tmp_path / "run"
    done = cli_fit(capfd, write_run_config(tmp_path), run, builtin_cache, f"--data.tokenizer={tokenizer}", check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{tokenizer / 'added_tokens.json'}: a link to /proc/" in done.stderr, done.stderr[-3000:]
    assert MARKER not in done.stdout + done.stderr
    assert not list(run.rglob("*.ckpt")) and saved_steps(run / "checkpoints") == []
