"""A ``torch.distributed.checkpoint`` file reader that never runs code from the checkpoint.

DCP keeps its index (``.metadata``) as a pickle and its stock reader unpickles it without
restriction, so a crafted file could run arbitrary code on load. This reader unpickles the
index with an allow-list of the classes a DCP index is made of (metadata records, ``torch.Size``,
dtypes, paths) and refuses anything else; tensor data is read as before (raw bytes).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """The checkpoint index references something other than DCP's own metadata types."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"checkpoint index refers to {module}.{name}, which is not a DCP metadata type")


class SafeFileSystemReader(dcp.FileSystemReader):
    """:class:`torch.distributed.checkpoint.FileSystemReader` with an allow-listed index unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path: Any
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # torch 2.7: one index file, no per-rank ones
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _IndexUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
