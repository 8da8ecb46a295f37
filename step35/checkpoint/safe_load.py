"""The unpickling policy for every checkpoint step35 reads: checkpoints are data, never code.

- Lightning checkpoints (a single `.ckpt`, the `meta.pt` of a sharded folder) are read with
  `torch.load(weights_only=True)` plus an explicit allowlist (`checkpoint_types()`) of the few
  non-primitive types their dicts can hold. Saved by step35 they hold only dicts, lists, tuples,
  numbers, strings, tensors and OrderedDicts (checked on real checkpoints); the allowlist adds the
  types a user's hyper-parameters may carry (paths, Lightning's AttributeDict).
- A DCP folder's `.metadata` is a plain pickle that torch's `FileSystemReader` unpickles with
  `pickle.load`. `safe_reader(folder)` reads it with `restricted_unpickle`, which admits only the
  classes of DCP's metadata (the set found by saving real sharded checkpoints: the dataclasses of
  `torch.distributed.checkpoint.metadata`, `filesystem._StorageInfo`, torch.Size, dtypes, layouts,
  paths), and refuses any entry whose `relative_path` leaves the folder (absolute, `..`, a symlink
  out).
- The `.distcp` data files hold two kinds of items. Tensors: DCP reads them with
  `torch.load(weights_only=True)` itself. Non-tensor (BYTES) items, such as the optimizer's
  `param_groups` values (lr, betas, eps, ...): DCP's default planner would read them with
  `torch.load(weights_only=False)`, i.e. run any pickle. `safe_reader`'s `read_data` reads every
  such item first with `torch.load(weights_only=True)` and the allowlist above, and hands the
  planner only a fresh serialization of the checked value. `check_bytes_items(folder)` runs the same
  check over all of a folder's BYTES items without loading anything else (a readable early refusal
  for every reader of a sharded folder, export and generate included).
- safetensors (HF folders) holds no code at all.

Anything else makes the load stop before a single object is built: a CheckpointError names the file
and the refused global. The private torch names used here (`_StorageInfo`, `_MEM_FORMAT_ENCODING`,
`torch.serialization._get_layout`, `FileSystemReader._get_metadata_path`, `FileSystemReader.storage_data`)
live only in this module; when torch moves one, the error says so and points here.
"""

from __future__ import annotations

import errno
import importlib
import io
import pathlib
import pickle
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from step35.checkpoint.errors import CheckpointError

_HERE = "step35/checkpoint/safe_load.py"

# --- Lightning checkpoint dicts (torch.load weights_only=True) -------------------------------------


def checkpoint_types() -> list:
    """Types admitted (besides torch's own weights_only set) in `.ckpt` / `meta.pt` files."""
    from lightning.fabric.utilities.data import AttributeDict

    return [
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        AttributeDict,
    ]


# torch's refusal names the global after "GLOBAL" ("Unsupported global: GLOBAL argparse.Namespace was not an allowed
# global"; "unsupported GLOBAL posix.system whose module posix is blocked"); older torch said "Unsupported class X"
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|[Uu]nsupported class\W+([\w.]+)")


def refusal(path: Path, error: BaseException) -> CheckpointError:
    """The one-line error for a weights_only refusal by torch.load: the file, the Python object it asked for (a
    class or function outside the allowlist), that nothing ran, and what to do."""
    found = _REFUSED_GLOBAL.search(str(error))
    what = f"the Python object {found.group(1) or found.group(2)}" if found else "a Python object"
    return CheckpointError(
        f"{path}: refused to unpickle: it asks for {what}, which is not on step35's allowlist of the types a "
        "checkpoint holds (torch.load with weights_only=True), so nothing from the file was run. step35's own "
        f"checkpoints never hold it; if you trust this file, add it to checkpoint_types() in {_HERE}"
    )


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def load_torch(path: str | Path, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """`torch.load` of a Lightning checkpoint file with weights_only=True and the step35 allowlist;
    unreadable or refused files raise a one-line CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        with torch.serialization.safe_globals(checkpoint_types()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise refusal(path, e) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:  # truncated zip, bad record, ...
        raise CheckpointError(
            f"{path}: unreadable checkpoint file, truncated or not written by torch.save "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from None


def load_bytes_item(value: io.BytesIO, source: str | Path, key: str) -> io.BytesIO:
    """A DCP BYTES item (`value`, read from the data file `source`) checked by
    `torch.load(weights_only=True)` with the allowlist, returned as a fresh `torch.save` of the
    checked value: whatever unpickles the result afterwards (DCP's planner, with weights_only=False)
    only rebuilds data this loader has already built without running code."""
    try:
        with torch.serialization.safe_globals(checkpoint_types()):
            obj = torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refusal(Path(source), e) from None
    except Exception as e:  # truncated or garbled item
        raise CheckpointError(f"{source}: unreadable item {key} ({type(e).__name__}: {_first_line(e)})") from None
    clean = io.BytesIO()
    torch.save(obj, clean)
    clean.seek(0)
    return clean


@contextmanager
def lightning_types() -> Iterator[None]:
    """For code that calls torch.load(weights_only=True) itself (Lightning's loaders): admit the allowlist."""
    with torch.serialization.safe_globals(checkpoint_types()):
        yield


# --- DCP `.metadata` (restricted unpickler) --------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # dtypes are checked by value below
    "torch.serialization": {"_get_layout"},  # name -> torch.layout, nothing else
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name not in _ALLOWED.get(module, ()):
            raise CheckpointError(
                f"{self.source}: refused to unpickle (it asks for {module}.{name}, which DCP "
                f"metadata never holds); a checkpoint holds data only, so nothing from it was run"
            )
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise CheckpointError(
                f"{self.source}: holds {module}.{name}, which this torch ({torch.__version__}) "
                f"no longer has: a checkpoint from another torch version? (allowlist in {_HERE})"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source}: refused to unpickle (persistent id {pid!r} in DCP metadata)")


def restricted_unpickle(file: io.BufferedIOBase | Any, source: str | Path) -> Any:
    """Unpickle DCP metadata from `file`, admitting only DCP's metadata classes."""
    source = Path(source)
    try:
        return _RestrictedUnpickler(file, source).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled pickle
        raise CheckpointError(f"{source}: unreadable DCP metadata ({type(e).__name__}: {str(e)[:200]})") from None


def leaves_folder(folder: Path, rel: Any, also_inside: Iterable[Path] = ()) -> str | None:
    """Why opening the file a checkpoint's listing names as `rel` (relative to `folder`) would leave
    `folder`: an absolute path, a `..`, a symlink out (None: it stays inside `folder`, or one of the
    resolved folders `also_inside`). The one rule of every listing step35 opens files from."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return "outside the checkpoint folder"
    target = (folder / rel).resolve()
    if not any(target.is_relative_to(root) for root in (folder.resolve(), *also_inside)):
        return "which resolves outside the checkpoint folder"
    return None


def check_inside(metadata: Any, folder: Path, source: Path) -> None:
    """Every data file `.metadata` points at lies inside `folder` (`leaves_folder`; DCP itself would
    open whatever path an entry names)."""
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        rel = getattr(info, "relative_path", None)
        reason = leaves_folder(folder, rel)
        if reason:
            raise CheckpointError(
                f"{source}: entry {getattr(index, 'fqn', index)} points at {rel!r}, {reason}; refused"
            )


def read_dcp_metadata(folder: str | Path):
    """The `Metadata` of the DCP folder `folder`, read through the restricted unpickler."""
    return safe_reader(folder).read_metadata()


_reader_class = None


def safe_reader(folder: str | Path):
    """A DCP storage reader for `folder` (torch's FileSystemReader) whose metadata read runs no code.
    Built on first use: importing torch.distributed.checkpoint takes a while."""
    global _reader_class
    if _reader_class is None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta

        class SafeFileSystemReader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any):
                try:
                    path = Path(self._get_metadata_path(kwargs.get("rank")))
                    stream = self.fs.create_stream(path, "rb")
                except AttributeError as e:
                    raise CheckpointError(
                        f"torch {torch.__version__} changed FileSystemReader ({e}); update {_HERE}"
                    ) from None
                except FileNotFoundError:
                    raise CheckpointError(
                        f"{Path(self.path) / '.metadata'}: missing (not a complete DCP checkpoint)"
                    ) from None
                with stream as f:
                    metadata = restricted_unpickle(f, path)
                check_inside(metadata, Path(self.path), path)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

            def read_data(self, plan: Any, planner: Any) -> Any:
                return super().read_data(plan, _SafeBytesPlanner(planner, self))

        _reader_class = SafeFileSystemReader
    return _reader_class(folder)


class _SafeBytesPlanner:
    """Stands in for DCP's load planner inside `SafeFileSystemReader.read_data`: BYTES items go
    through `load_bytes_item` before the planner sees them; everything else is the planner's."""

    def __init__(self, planner: Any, reader: Any):
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            relative = self._reader.storage_data[read_item.storage_index].relative_path
        except (AttributeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"torch {torch.__version__} changed FileSystemReader.storage_data ({e}); update {_HERE}"
            ) from None
        source = Path(self._reader.path) / relative
        self._planner.load_bytes(read_item, load_bytes_item(value, source, read_item.dest_index.fqn))


class _CheckOnly:
    """A planner for `check_bytes_items`: the checked values are dropped."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        pass


def check_bytes_items(folder: str | Path) -> int:
    """Read every non-tensor (BYTES) item of the DCP folder `folder` through the restricted loader,
    without loading any tensor and without collectives; returns how many there were. A pickle that
    asks for code raises a CheckpointError naming the data file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = safe_reader(folder)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    items = [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=index,
            dest_offsets=torch.Size((0,)),
            storage_index=index,
            storage_offsets=torch.Size((0,)),
            lengths=torch.Size((0,)),
        )
        for index in (metadata.storage_data or {})
        if getattr(index, "fqn", None) in byte_keys
    ]
    reader.read_data(LoadPlan(items), _CheckOnly()).wait()
    return len(items)


# --- loaded values ---------------------------------------------------------------------------------


def check_finite(named: Iterable[tuple[str, torch.Tensor]], source: str | Path) -> None:
    """Refuse NaN/Inf in loaded floating-point tensors, naming the first bad one and its source."""
    for name, tensor in named:
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        if tensor.device.type == "meta":
            continue
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            kind = "NaN" if bool(torch.isnan(tensor).any()) else "Inf"
            raise CheckpointError(
                f"{source}: tensor {name} holds {kind} ({bad} of {tensor.numel()} values "
                f"not finite); refusing to load it"
            )


def open_safetensors(file: Path):
    """`safe_open(file)` for torch (use it in a `with`), a file that cannot be opened refused in one line
    naming it and what to do. safetensors maps the whole file at open: a map refused by the process's limits is
    told apart from a damaged header (bad length, truncated JSON), which says nothing about the file's bytes."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors' SafetensorError, MemoryError, OSError
        raise CheckpointError(unopenable(file, e)) from None


def unopenable(file: Path, error: Exception) -> str:
    """The one line for a safetensors file that could not be opened (`open_safetensors`)."""
    cause = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "mmap" in str(error) or getattr(error, "errno", None) == errno.ENOMEM:
        size = f"{file.stat().st_size / 2**30:.1f} GiB" if file.is_file() else "its size"
        return (
            f"{file}: cannot be mapped into memory ({cause}): mapping {size} exceeds this process's limit "
            "(ulimit -v, a container's memory limit or vm.overcommit_memory=2); raise the limit for it"
        )
    return (
        f"{file}: unreadable safetensors file ({cause}); its header is damaged or the file is cut short: "
        "download or copy it again"
    )
