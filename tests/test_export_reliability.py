"""`step35 export` and the readers of start folders under misuse (issue 42): a file of the start folder (or of a
tokenizer folder) that links out of it is never copied into an export or a checkpoint, a link inside the folder
and a hub cache snapshot's links into its `blobs/` still are.

Before these fixes `LICENSE -> /proc/self/environ` in a start folder published the exporting process's
environment (its API keys) as the export's LICENSE, and a tokenizer file linking out was recorded in every
checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from step35.checkpoint.hf.pretrained import load_pretrained
from step35.checkpoint.training import run_tokenizer
from step35.checkpoint.training.trainer_io import remove
from step35.cli import main
from step35.commands.generate import load_generator
from step35.data import builtin_tokenizer_dir
from step35.eval import generator as generator_module
from step35.run import resolution
from tests.helpers import saved_steps, write_run_config
from tests.runner import Job, cli_fit, command, wait_for
from tests.test_export import copied_lines, home_like_folder
from tests.test_run import hold, kill9

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


# ------------------------------------------------------------------------------ 2. a live run pruning (keep_last 1)
@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run folder: checkpoints/step=000003.ckpt with its manifest, last.ckpt."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run, symlinks=True)
    return run


def save_and_prune(checkpoint: Path, step: int) -> Path:
    """What a live run saving every step with keep_last 1 does next: a newer save (`checkpoint`'s bytes under the
    name of `step`), then `checkpoint` pruned (manifest first, trainer_io.remove). Returns the new checkpoint."""
    newer = checkpoint.with_name(f"step={step:06d}.ckpt")
    manifest = json.loads(checkpoint.with_name(checkpoint.name + ".manifest.json").read_text())
    manifest["extra"]["global_step"] = step
    shutil.copyfile(checkpoint, newer)
    newer.with_name(newer.name + ".manifest.json").write_text(json.dumps(manifest))
    remove(checkpoint)
    return newer


@pytest.fixture
def pruned_after_listing(monkeypatch) -> list[Path]:
    """The first checkpoint checked after the run folder was listed is pruned just before its check (a newer one
    saved), as a live run keeping one does between the list and the read. Returns the checkpoints saved."""
    real, saved = resolution._intact, []

    def intact(path: Path):
        if not saved:
            saved.append(save_and_prune(path, 6))
        return real(path)

    monkeypatch.setattr(resolution, "_intact", intact)
    return saved


def test_a_checkpoint_pruned_between_the_list_and_its_check_is_not_damaged(run_copy, tmp_path, pruned_after_listing):
    out = tmp_path / "hf"
    main(["export", "--checkpoint", str(run_copy), "--out", str(out)])  # before: "every one is damaged", a traceback
    assert pruned_after_listing == [run_copy / "checkpoints" / "step=000006.ckpt"]
    assert load_pretrained(out) is not None
    generator = load_generator(run_copy)  # generate reads it the same way
    assert generator.model is not None


def test_generate_reads_the_newest_checkpoint_when_the_one_chosen_is_pruned_while_read(run_copy, monkeypatch):
    real, pruned = generator_module.open_checkpoint, []

    def open_checkpoint(path, config=None):
        if not pruned:
            pruned.append(save_and_prune(run_copy / "checkpoints" / "step=000003.ckpt", 6))
        return real(path, config)

    monkeypatch.setattr(generator_module, "open_checkpoint", open_checkpoint)
    said = []
    generator = load_generator(run_copy, say=said.append)  # before: "step=000003.ckpt: no such checkpoint"
    assert f"model: {pruned[0]}; tokenizer:" in "\n".join(said), said
    assert any("was removed or replaced while it was being read" in line for line in said), said
    assert generator.model is not None


def test_a_run_folder_whose_checkpoints_are_all_damaged_is_one_line(run_copy, tmp_path):
    checkpoint = run_copy / "checkpoints" / "step=000003.ckpt"
    with open(checkpoint, "ab") as grown:  # a size the manifest does not record: damaged, still there
        grown.write(b"\0")
    with pytest.raises(SystemExit) as refusal:  # before: NoCheckpoint, a traceback
        main(["export", "--checkpoint", str(run_copy), "--out", str(tmp_path / "hf")])
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"step35 export: {run_copy}: every checkpoint in "), message
    assert f"{run_copy / 'checkpoints'} is damaged (" in message and "the manifest says" in message, message


LIVE_RUNS = {  # a run saving at every step and keeping one: the case the probe found failing
    "one_process": ([], 1),
    "one_process_async_saves": (["--trainer.callbacks.async_save=true"], 1),
    "two_ranks": (  # sharded (DCP) checkpoints: a read outlasts several steps, so only the reader's hold helps
        [
            "--trainer.strategy=step35.strategy.Step35Strategy",
            "--trainer.strategy.expert_parallel_size=2",
            "--trainer.devices=2",
        ],
        2,
    ),
}


@pytest.mark.heavy  # a training job beside the exports
@pytest.mark.parametrize("live", list(LIVE_RUNS))
def test_ten_exports_in_a_row_of_a_live_run_pruning_to_one_checkpoint_all_succeed(live, tmp_path, builtin_cache):
    extra, nproc = LIVE_RUNS[live]
    run, out = tmp_path / "run", tmp_path / "hf"
    args = ["fit", "--config", str(write_run_config(tmp_path)), f"--run_dir={run}", "--trainer.max_steps=100000"]
    every_step = ["--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.keep_last=1"]
    with Job(command([*args, *every_step, *extra], nproc=nproc), tmp_path / "fit.log", builtin_cache) as job:
        wait_for(lambda: saved_steps(run / "checkpoints"), 300, job, "a first checkpoint")
        failures, exported = [], []
        for _ in range(10):
            try:
                main(["export", "--checkpoint", str(run), "--out", str(out)])
                exported.append(json.loads((out / "step35.manifest.json").read_text()))
            except (SystemExit, Exception) as error:  # every failure counted, with its message
                failures.append(f"{type(error).__name__}: {error}")
        assert job.proc.poll() is None, f"the run ended before the exports did:\n{job.output()[-3000:]}"
    assert failures == [], f"{len(failures)} of 10 exports failed: {failures}"
    assert len(exported) == 10 and load_pretrained(out) is not None


# ------------------------------------------------------------------------------ 3. --overwrite and a live run's folder
def listing(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` with its bytes (what must be untouched)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.heavy  # a process holds the lock
def test_overwrite_never_replaces_a_live_runs_folder_nor_one_holding_it(tiny_run, tmp_path):
    other = tmp_path / "runs" / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "step=000005.ckpt").write_bytes(b"another job's save")
    (other / "config.yaml").write_text("model:\n  config: tiny\n")
    holder, _ = hold(other)
    try:
        before = listing(tmp_path / "runs")
        for out in (other, tmp_path / "runs"):
            with pytest.raises(SystemExit) as refusal:  # before: replaced, rc 0
                main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(out), "--overwrite", "true"])
            message = str(refusal.value)
            assert "\n" not in message and f"--out {out} is, or holds, the folder of a live run (pid {holder.pid} " in (
                message
            ), message
            assert f"lock {other / '.step35.lock'}): refused, even with --overwrite" in message, message
            assert listing(tmp_path / "runs") == before
    finally:
        kill9(holder)
    main(["export", "--checkpoint", str(tiny_run[0]), "--out", str(other), "--overwrite", "true"])  # its run ended
    assert load_pretrained(other) is not None
