"""A sharded policy's ``sharded/`` folder (``torch.distributed.checkpoint``, DCP), read without
running pickled code.

DCP's own reader unpickles the folder's ``.metadata`` (a ``Metadata`` object: where every shard
lies) with plain ``pickle.load`` (``FileSystemReader.read_metadata``; pytorch/pytorch#189308),
and every non-tensor value (the optimizer's hyperparameters) with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``): a crafted run folder
would run code on ``--resume``. Here the metadata is unpickled with an allow-list of DCP's
metadata classes and the torch types they hold, so a pickle that names anything else is refused
before anything in it runs; it may name only shard files of its own folder; and non-tensor
values load with ``weights_only=True``. The files are DCP's own, unchanged: resharding (N ranks
onto M, or one process) works as before, and folders written before this check read the same.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from atgrpo.checkpoint.steps import CheckpointError, pickle_refused

METADATA_FILE = ".metadata"  # DCP's name for it (filesystem._metadata_fn)

# Everything the metadata pickle of torch 2.13's DCP names: its dataclasses, the tensor shapes,
# layouts and memory formats they hold, and the checkpoint's path; torch dtypes are allowed by
# name in find_class. Each of these only builds data when called or restored. A torch that
# pickles more is refused, naming what (test_sharding.py saves and reads one back).
_ALLOWED: dict[str, Any] = {
    f"{obj.__module__}.{obj.__qualname__}": obj
    for obj in (
        dcp_metadata.Metadata,
        dcp_metadata.StorageMeta,
        dcp_metadata.MetadataIndex,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        torch.serialization._get_layout,
    )
}
_ALLOWED["pathlib.PosixPath"] = PosixPath  # StorageMeta.checkpoint_id
_ALLOWED["pathlib._local.PosixPath"] = PosixPath  # as Python 3.13 names it


class _Refused(pickle.UnpicklingError):
    """A name outside the allow-list, worded as torch's weights-only unpickler words it."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names in :data:`_ALLOWED` and torch dtypes: a pickle that names any
    other callable (``os.system``, ``builtins.exec``) stops before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get(f"{module}.{name}")
        if found is None and module == "torch":
            dtype = getattr(torch, name, None)
            found = dtype if isinstance(dtype, torch.dtype) else None
        if found is None:
            raise _Refused(f"Unsupported global: GLOBAL {module}.{name}")
        return found


def read_metadata(folder: Path) -> Metadata:
    """``folder``'s DCP metadata, unpickled with the allow-list; a pickle that names anything
    else, a file that is no DCP metadata, or one that names a shard file not in ``folder``, is a
    :class:`CheckpointError` naming the file."""
    path = folder / METADATA_FILE
    metadata = _unpickle(path)
    if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict)):
        raise _unreadable(path, f"it holds a {type(metadata).__name__}")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name == Path(name).name and (folder / name).is_file()):
            raise CheckpointError(
                f"{path} names {name!r}, no shard file beside it: refusing to load it: resume "
                "or evaluate a checkpoint atgrpo wrote"
            )
    return metadata


# What unpickling a damaged or foreign file raises (beyond a refused name).
_UNREADABLE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, LookupError, AttributeError)


def _unpickle(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            return _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise pickle_refused(path, exc, "DCP's checkpoint metadata") from None
    except FileNotFoundError:
        raise _unreadable(path, "the file is missing") from None
    except _UNREADABLE as exc:
        raise _unreadable(path, f"{type(exc).__name__}: {exc}") from None


def _unreadable(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is no torch.distributed.checkpoint metadata ({why})")


def load_shards(state: dict[str, Any], folder: Path, *, no_dist: bool) -> None:
    """``dcp.load`` of ``folder`` into ``state`` (in place, resharded onto its layout), its
    metadata read by :func:`read_metadata` and its non-tensor values with ``weights_only``."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(folder)
    planner = _SafePlanner()
    dcp.load(
        state, storage_reader=_CheckedReader(folder, metadata), planner=planner, no_dist=no_dist
    )
    if planner.refused:  # raised here: DCP wraps what its planner raises into its own error
        index, exc = planner.refused[0]
        shard = folder / metadata.storage_data[index].relative_path
        raise pickle_refused(shard, exc, "tensors and plain data")


class _CheckedReader(FileSystemReader):
    """DCP's file reader, handed the metadata :func:`read_metadata` has read."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:  # as FileSystemReader.read_metadata does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, but a non-tensor value loads with ``weights_only``; one that
    pickles more is left unloaded and recorded in ``refused``."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[tuple[MetadataIndex, pickle.UnpicklingError]] = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            self.refused.append((read_item.storage_index, exc))
            return
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
