"""Checkpoints are data, not code, and damage is named, not loaded.

- Crafted pickles (a DCP `.metadata`, a sharded folder's `meta.pt`, a single-file `.ckpt`, a
  non-tensor item of a `.distcp` shard that a clean `.metadata` points at) whose payload would create
  a marker file are refused by `step35 fit --ckpt_path`, `step35 validate` and `step35 export` (and
  `step35 generate` for the shard item), the real CLI (step35.cli.main, in this process), naming the
  file; the marker never appears. The crafted files carry a freshly written manifest, as an attacker would leave
  them, so it is the unpickling policy that stops them, not the checksums.
- A `.metadata` entry pointing outside the folder (`../x.distcp`, an absolute path) is refused by name.
- Flipped byte, truncated file, deleted file, NaN weights in a sharded folder, a `.ckpt` and an HF
  folder: refused at load (resume, export, from_pretrained) with the file or tensor named.
- 2 ranks: a damaged shard fails the resume on every rank (tests/test_fail_fast.py, on its 2-rank run's checkpoint).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from step35.checkpoint.errors import CheckpointError
from step35.checkpoint.hf.pretrained import load_pretrained, save_pretrained
from step35.checkpoint.integrity import is_complete, manifest_info, manifest_path, verify, write_manifest
from step35.checkpoint.safe_load import load_torch, read_dcp_metadata
from step35.checkpoint.training.export import export_checkpoint
from step35.checkpoint.training.trainer_io import load_file
from step35.data import Step35DataModule
from step35.module import Step35LightningModule
from step35.strategy import Step35Strategy
from tests.helpers import checkpoint_io, flip_byte, make_trainer, tiny_model, tiny_run_args

ROOT = Path(__file__).parent.parent
SHARDED = ["--trainer.strategy=step35.strategy.Step35Strategy", "--trainer.strategy.expert_parallel_size=1"]


def error_line(stderr: str, text: str) -> str:
    """The line of `stderr` that holds `text` (the error's message, not the source line raising it)."""
    line = next((ln for ln in stderr.splitlines() if text in ln), None)
    assert line is not None, stderr[-3000:]
    return line


def run_args(command: str, run: Path, sharded: bool, *extra: str) -> list[str]:
    return tiny_run_args(command, run, *(SHARDED if sharded else []), *extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, builtin_cache) -> dict[str, Path]:
    """A 2-step run of each kind through the CLI (in this process): {"file": last.ckpt, "sharded": last.ckpt/ (DCP)}."""
    from step35.cli import main

    out = {}
    for kind in ("file", "sharded"):
        run = tmp_path_factory.mktemp(kind)
        with pytest.MonkeyPatch.context() as patch:  # as tests/runner.step35 starts a job: the root, the cache
            patch.chdir(ROOT)
            patch.setenv("STEP35_CACHE", str(builtin_cache))
            main(run_args("fit", run, kind == "sharded", "--trainer.max_steps=2"))
        out[kind] = run / "checkpoints" / "last.ckpt"  # the run folder's pointer to its newest checkpoint
        assert is_complete(out[kind]), list(out[kind].parent.iterdir())
    return out


# ------------------------------------------------------------------------------- crafted pickles
class Payload:
    """Unpickling this runs a command that creates `marker` (os.system) or runs Python (exec)."""

    def __init__(self, marker: Path, how: str):
        self.marker, self.how = str(marker), how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"touch {self.marker}",)
        return exec, (f"open({self.marker!r}, 'w').close()",)


def craft(kind: str, checkpoints: dict[str, Path], where: Path, marker: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint with one file replaced by a payload; returns (checkpoint, that file)."""
    if kind == "ckpt":
        path = where / "evil.ckpt"
        state = load_torch(checkpoints["file"])
        state["loops"]["fit_loop"]["payload"] = Payload(marker, "exec")
        torch.save(state, path)
        write_manifest(path)
        return path, path
    path = where / "evil_sharded.ckpt"
    shutil.copytree(checkpoints["sharded"], path)
    if kind == "bytes":  # a clean .metadata whose lr item points at a pickle appended to a shard
        bad = path / "__0_0.distcp"
        payload = io.BytesIO()
        torch.save(Payload(marker, "system"), payload)
        repoint(path, bad.name, bad.stat().st_size, len(payload.getvalue()), lambda key: key.endswith(".lr"))
        with open(bad, "ab") as f:
            f.write(payload.getvalue())
    elif kind == "metadata":  # DCP's real metadata, with the payload riding along in a field
        metadata = read_dcp_metadata(path)
        metadata.planner_data = {"note": Payload(marker, "system")}
        with open(path / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        bad = path / ".metadata"
    else:
        state = load_torch(path / "meta.pt")
        state["hyper_parameters"]["lr"] = Payload(marker, "exec")
        torch.save(state, path / "meta.pt")
        bad = path / "meta.pt"
    write_manifest(path)  # as an attacker would: the checksums match the crafted files
    return path, bad


def repoint(folder: Path, relative_path: str, offset: int, length: int, which) -> str:
    """Rewrite `folder/.metadata` (a clean pickle of DCP's own classes) so that the first non-tensor
    item whose key passes `which` is read from `relative_path` at `offset`; returns its key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder)
    index = next(
        i
        for i in metadata.storage_data
        if which(i.fqn) and isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], relative_path=relative_path, offset=offset, length=length
    )
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return index.fqn


def test_payloads_are_live(checkpoints, tmp_path):
    """The crafted files really run their payload when unpickled the old way (so the refusals below mean something)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    for kind in ("metadata", "meta.pt", "ckpt", "bytes"):
        marker = tmp_path / f"marker-{kind}"
        (tmp_path / kind).mkdir()
        path, bad = craft(kind, checkpoints, tmp_path / kind, marker)
        if kind == "bytes":  # what the resume did before: DCP's default planner reads the optimizer's param_groups
            key = next(k for k in FileSystemReader(path).read_metadata().state_dict_metadata if k.endswith(".lr"))
            with pytest.warns(UserWarning):  # (no process group: "assuming the intent is to load in a single process")
                dcp.load({key: 0.0}, storage_reader=FileSystemReader(path))
        elif kind == "metadata":
            FileSystemReader(path).read_metadata()  # what Lightning's resume and the old export did
        else:
            torch.load(bad, weights_only=False)  # what the old export did
        assert marker.exists(), kind


@pytest.mark.parametrize(
    "kind,command",
    [(kind, command) for kind in ("metadata", "meta.pt", "ckpt") for command in ("fit", "validate", "export")]
    + [("bytes", command) for command in ("fit", "validate", "export", "generate")],
)
def test_crafted_checkpoint_is_refused_and_runs_nothing(kind, command, checkpoints, step35_here, tmp_path):
    (tmp_path / "in").mkdir()
    marker = tmp_path / "marker"
    path, bad = craft(kind, checkpoints, tmp_path / "in", marker)
    if command == "export":
        code, out, err = step35_here("export", "--checkpoint", str(path), "--out", str(tmp_path / "hf"))
    elif command == "generate":
        code, out, err = step35_here("generate", "--checkpoint", str(path), "--prompt", "Once", "--max_new_tokens", "2")
    else:
        extra = ["--trainer.max_steps=3"] if command == "fit" else []
        code, out, err = step35_here(
            *run_args(command, tmp_path / "run", kind != "ckpt", f"--ckpt_path={path}", *extra)
        )
    assert code != 0, out[-2000:]
    assert not marker.exists(), "the payload ran"
    line = error_line(err, f"{bad}: refused to unpickle")
    assert len(line) < 500, line
    assert not (tmp_path / "hf").exists()


def test_bytes_item_refused_by_the_loader_itself(checkpoints, tmp_path):
    """The guard is in the reader DCP calls, not only in the early check: a crafted shard item loaded
    straight through `dcp_load` is refused naming the shard, and the marker never appears."""
    from step35.checkpoint.training.trainer_io import dcp_load

    marker = tmp_path / "marker"
    path, bad = craft("bytes", checkpoints, tmp_path, marker)
    key = next(k for k in read_dcp_metadata(path).state_dict_metadata if k.endswith(".lr"))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=f"{bad}: refused to unpickle"):
        dcp_load({key: 0.0}, path)
    assert not marker.exists()
    clean = next(k for k in read_dcp_metadata(checkpoints["sharded"]).state_dict_metadata if k.endswith(".lr"))
    state = {clean: None}
    with pytest.warns(UserWarning):
        dcp_load(state, checkpoints["sharded"])  # an untouched item still loads, with its value
    assert isinstance(state[clean], float) and state[clean] > 0, state


@pytest.mark.parametrize("where", ["../outside.distcp", "absolute"])
def test_metadata_pointing_outside_the_folder_is_refused(where, checkpoints, builtin_cache, tmp_path):
    path = tmp_path / "evil.ckpt"
    shutil.copytree(checkpoints["sharded"], path)
    outside = tmp_path / "outside.distcp"
    shutil.copy(path / "__0_0.distcp", outside)  # a readable file is there: only the path check can stop it
    target = str(outside) if where == "absolute" else where
    key = repoint(path, target, 0, 16, lambda key: True)
    write_manifest(path)
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(path)
    message = str(err.value)
    assert f"{path / '.metadata'}: entry {key} points at {target!r}, outside the checkpoint folder" in message
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        resume_in_process(path, True, builtin_cache)


# --------------------------------------------------------------------------------- damaged files
def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_flipped_byte_refused_by_resume(kind, checkpoints, step35_here, tmp_path):
    path = tmp_path / "last.ckpt"
    (shutil.copytree if kind == "sharded" else shutil.copy)(checkpoints[kind], path)
    if kind == "file":
        shutil.copy(manifest_path(checkpoints[kind]), manifest_path(path))
    damaged = path / "__0_0.distcp" if kind == "sharded" else path
    flip_byte(damaged)
    code, _, err = step35_here(
        *run_args("fit", tmp_path / "run", kind == "sharded", f"--ckpt_path={path}", "--trainer.max_steps=3")
    )
    assert code != 0
    error_line(err, f"{damaged}: checksum mismatch")


def resume_in_process(path: Path, sharded: bool, cache: Path) -> pl.Trainer:
    """The real resume path (Trainer.fit with ckpt_path) in this process: Step35Strategy for a sharded
    folder, the CheckpointIO the CLI installs for a file."""
    data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(cache))
    module = Step35LightningModule(config="tiny", warmup_steps=1)
    trainer = make_trainer(
        max_steps=3, enable_checkpointing=False, default_root_dir=path.parent, **checkpoint_io(sharded)
    )
    trainer.fit(module, datamodule=data, ckpt_path=path)
    return trainer


def nan_sharded(source: Path, path: Path) -> str:
    """A sharded checkpoint whose weights hold a NaN, with a correct manifest (written as if by a diverged run)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(source, path.parent / "full.pt")
    state = torch.load(path.parent / "full.pt", weights_only=True)
    name = "model.model.layers.1.self_attn.o_proj.weight"
    state["state_dict"][name].view(-1)[7] = float("nan")
    torch.save(state, path.parent / "full.pt")
    torch_save_to_dcp(path.parent / "full.pt", path)
    shutil.copy(source / "meta.pt", path / "meta.pt")
    write_manifest(path)
    return name


def nan_file(source: Path, path: Path) -> str:
    state = load_torch(source)
    name = "model.lm_head.weight"
    state["state_dict"][name][0, 0] = float("inf")
    torch.save(state, path)
    write_manifest(path)
    return name


DAMAGE = {  # name: (kind, damage(path) -> the text the error must hold)
    "sharded-truncated-shard": ("sharded", lambda p: (truncate(p / "__0_0.distcp"), str(p / "__0_0.distcp"))[1]),
    "sharded-deleted-shard": (
        "sharded",
        lambda p: ((p / "__0_0.distcp").unlink(), f"{p / '__0_0.distcp'}: missing")[1],
    ),
    "sharded-deleted-metadata": ("sharded", lambda p: ((p / ".metadata").unlink(), f"{p / '.metadata'}: missing")[1]),
    "sharded-truncated-meta": ("sharded", lambda p: (truncate(p / "meta.pt"), str(p / "meta.pt"))[1]),
    "sharded-flipped-meta": ("sharded", lambda p: (flip_byte(p / "meta.pt"), str(p / "meta.pt"))[1]),
    "file-truncated": ("file", lambda p: (truncate(p), f"{p}: ")[1]),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_refused_by_resume_naming_the_file(case, checkpoints, builtin_cache, tmp_path):
    kind, damage = DAMAGE[case]
    path = tmp_path / "last.ckpt"
    if kind == "sharded":
        shutil.copytree(checkpoints[kind], path)
    else:
        shutil.copy(checkpoints[kind], path)
        shutil.copy(manifest_path(checkpoints[kind]), manifest_path(path))
    expected = damage(path)
    with pytest.raises(CheckpointError) as err:
        resume_in_process(path, kind == "sharded", builtin_cache)
    message = str(err.value)
    assert expected in message and "\n" not in message and len(message) < 400, message


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_nan_weights_refused_by_resume_and_export(kind, checkpoints, builtin_cache, tmp_path):
    path = tmp_path / "nan.ckpt"
    name = nan_sharded(checkpoints[kind], path) if kind == "sharded" else nan_file(checkpoints[kind], path)
    verify(path)  # the files are intact: it is the values that are refused
    with pytest.raises(CheckpointError, match="holds (NaN|Inf)") as err:
        resume_in_process(path, kind == "sharded", builtin_cache)
    assert name.removeprefix("model.") in str(err.value), str(err.value)
    with pytest.raises(CheckpointError, match="holds (NaN|Inf)") as err:
        export_checkpoint(path, tmp_path / "hf")
    assert name.removeprefix("model.") in str(err.value) and not (tmp_path / "hf").exists()


def test_damaged_sharded_checkpoint_refused_by_export(checkpoints, tmp_path):
    path = tmp_path / "last.ckpt"
    shutil.copytree(checkpoints["sharded"], path)
    flip_byte(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp: checksum mismatch"):
        export_checkpoint(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial*"))


def test_manifest_records_the_step_and_every_file(checkpoints):
    for kind, path in checkpoints.items():
        info = manifest_info(path)
        assert info["extra"]["global_step"] == 2 and info["extra"]["layout"] == ("dcp" if kind == "sharded" else "file")
        if kind == "sharded":
            assert sorted(info["files"]) == sorted(p.name for p in path.iterdir() if p.name != "step35.manifest.json")
        else:
            assert list(info["files"]) == ["."] and info["files"]["."]["size"] == path.stat().st_size


def test_checkpoint_without_manifest_loads_with_a_warning(checkpoints, tmp_path):
    path = tmp_path / "old.ckpt"
    shutil.copy(checkpoints["file"], path)  # as saved before manifests existed
    assert not is_complete(path)
    with pytest.warns(UserWarning, match="no step35 manifest"):
        state = load_file(path)
    assert state["global_step"] == 2


# ------------------------------------------------------------------------------------ HF folders
@pytest.fixture
def hf_folder(tmp_path) -> Path:
    path = tmp_path / "hf"
    save_pretrained(tiny_model(seed=3), path, max_shard_size=1_000_000)
    return path


def test_hf_flipped_byte_refused_naming_the_shard(hf_folder):
    shard = sorted(hf_folder.glob("model-*.safetensors"))[2]
    flip_byte(shard)
    with pytest.raises(CheckpointError, match=f"{shard.name}: checksum mismatch"):
        load_pretrained(hf_folder)


def test_hf_nan_weight_refused_naming_the_tensor(tmp_path):
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.model.layers[2].moe.down_proj.weight[1, 3, 5] = float("nan")
    save_pretrained(model, tmp_path / "hf", max_shard_size=1_000_000)
    with pytest.raises(CheckpointError, match="model.layers.2.moe.down_proj.weight holds NaN"):
        load_pretrained(tmp_path / "hf")


def test_hf_config_json_stays_editable(hf_folder):
    """The manifest covers weights and index; config.json is validated when read instead."""
    assert sorted(manifest_info(hf_folder)["files"]) == sorted(
        [p.name for p in hf_folder.glob("*.safetensors")] + ["model.safetensors.index.json"]
    )
    text = (hf_folder / "config.json").read_text()
    (hf_folder / "config.json").write_text(text.replace("{", "{\n  ", 1))
    load_pretrained(hf_folder)


def test_step35strategy_full_file_checkpoint_round_trip(tmp_path, builtin_cache):
    """Step35Strategy with save_distributed_checkpoint=False writes one file (with its manifest) through
    the same code; it resumes, and a flipped byte in it is refused."""

    def fit(max_steps: int, ckpt_path=None) -> pl.Trainer:
        data = Step35DataModule(seq_len=32, micro_batch_size=2, cache_dir=str(builtin_cache))
        module = Step35LightningModule(config="tiny", warmup_steps=1)
        trainer = make_trainer(
            strategy=Step35Strategy(save_distributed_checkpoint=False),
            max_steps=max_steps,
            default_root_dir=tmp_path,
            callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        )
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return trainer

    fit(2)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_file() and manifest_info(last)["extra"]["global_step"] == 2
    assert fit(3, ckpt_path=last).global_step == 3
    flip_byte(last)
    with pytest.raises(CheckpointError, match=f"{last}: checksum mismatch"):
        fit(4, ckpt_path=last)
