"""Encodings for data at rest that load without executing code: safetensors for tensors, JSON
for the rest, npz (read with allow_pickle=False) for arrays.

Nested learner state (optimizer state dicts with integer keys, RNG states, counters) is split by
`encode_state` into a flat tensor file and a JSON tree that points into it.
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported where tensors are encoded or decoded: the flow's modules import
# this one for arrays (shards) without them


def encode_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})


def decode_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def encode_state(tree: Any) -> tuple[bytes, bytes]:
    """(safetensors bytes, JSON bytes) for a nested state of dicts, lists, scalars and tensors."""
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def encode(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach().cpu()  # a learner's GPU state loads on a CPU-only machine
            return {"$tensor": path}
        if isinstance(node, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(node))
            return {"$ndarray": path}
        if isinstance(node, dict):
            return {"$dict": [[key, encode(value, f"{path}/{key}")] for key, value in node.items()]}
        if isinstance(node, (list, tuple)):
            return [encode(value, f"{path}/{i}") for i, value in enumerate(node)]
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot store {type(node).__name__} at {path or '/'} in a checkpoint")

    tree_json = json.dumps(encode(tree, "")).encode()
    return encode_tensors(tensors), tree_json


def decode_state(tensor_bytes: bytes, tree_json: bytes) -> Any:
    tensors = decode_tensors(tensor_bytes)

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(value) for value in node]
        if isinstance(node, dict):
            if "$tensor" in node:
                return tensors[node["$tensor"]]
            if "$ndarray" in node:
                return tensors[node["$ndarray"]].numpy()
            return {key: decode(value) for key, value in node["$dict"]}
        return node

    return decode(json.loads(tree_json))


def encode_arrays(arrays: dict[str, np.ndarray], compress: bool = False) -> bytes:
    """npz bytes (deflated at level 1 where `compress`: a third of level 6's time, for frames
    that are mostly flat colour); the same arrays give the same bytes."""
    buffer = io.BytesIO()
    if not compress:
        np.savez(buffer, **arrays)
        return buffer.getvalue()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, value in arrays.items():
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.asanyarray(value), allow_pickle=False)
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))  # numpy's fixed date
            archive.writestr(entry, npy.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
    return buffer.getvalue()


def decode_arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}
