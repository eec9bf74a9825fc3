"""Moving a State's objects to the ranks behind it: the tensors as raw bytes, the rest pickled.

Why not one torch.save blob (what State.sync did first): the source serialised every
tensor into one bytes object, copied it twice more on its way into a tensor, and each
receiver held the broadcast buffer, a bytes copy of it and the unpickled tensors at
once: about three copies of the whole state in host memory, plus, for NCCL, a trip
of every GPU tensor to the host and back on both sides. For a model whose weights and
optimizer moments fill much of a node's memory that does not fit, and it is slow
(measured in bench/state_transfer.py).

What moves instead:
1. The skeleton: each object's state_dict with every dense tensor replaced by a
   `TensorSlot` (its index, shape and dtype), pickled and broadcast. Small: the
   structure, the optimizer's hyperparameters, the sampler's position.
2. The tensors' bytes, back to back, in buckets of at most `bucket_bytes`: the
   source copies a bucket's worth into one flat uint8 buffer on the collective's
   device (the GPU for NCCL) and broadcasts it; each receiver copies the slices into
   host tensors it allocated from the skeleton. A tensor may span buckets, so the
   extra memory on the device is one bucket, whatever the largest tensor.
3. Only when every bucket has arrived does a receiver load the rebuilt state dicts
   (`load_state_dict` moves them to the objects' own devices, as loading a
   checkpoint does): a source lost mid-way fails a collective and leaves the
   receiver's objects as they were, never half-overwritten.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator

BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor stood in a state dict: its place in the byte stream's order."""

    index: int
    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype (pickles by name)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def split(states: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """(skeleton, tensors): `states` with each dense tensor replaced by its TensorSlot,
    and the tensors in slot order. Containers are dicts, lists and tuples (their own
    types kept, OrderedDict and named tuples included); anything else, a sparse or
    quantised tensor included, stays in the skeleton and is pickled with it."""
    import torch

    tensors: list[Any] = []

    def to_slot(value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and _plain(value)):
            return value
        tensors.append(value)
        return TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)

    return _map_leaves(states, to_slot), tensors


def fill(skeleton: Any, tensors: list[Any]) -> Any:
    """The skeleton with each TensorSlot replaced by its received tensor."""
    return _map_leaves(skeleton, lambda value: tensors[value.index]
                       if isinstance(value, TensorSlot) else value)


def slots(skeleton: Any) -> list[TensorSlot]:
    """The skeleton's TensorSlots in index order."""
    found: list[TensorSlot] = []
    _map_leaves(skeleton, lambda value: found.append(value)
                if isinstance(value, TensorSlot) else None)
    return sorted(found, key=lambda slot: slot.index)


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` rebuilt with `leaf` applied to everything that is not a dict, list or
    tuple (whose own types are kept: OrderedDict, named tuples)."""
    if isinstance(value, dict):
        rebuilt = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            rebuilt[key] = _map_leaves(item, leaf)
        return rebuilt
    if isinstance(value, (list, tuple)):
        items = [_map_leaves(item, leaf) for item in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return leaf(value)


def _plain(tensor: Any) -> bool:
    """A dense tensor whose bytes are its value (not sparse, quantised or on meta)."""
    import torch

    return (tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.device.type != "meta" and type(tensor) in (torch.Tensor,
                                                                  torch.nn.Parameter))


def buckets(sizes: list[int], bucket_bytes: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """The byte stream of tensors of `sizes` bytes, cut into buckets of at most
    `bucket_bytes`: per bucket, its segments (tensor index, offset in the tensor,
    offset in the bucket, length). Empty tensors have no segment."""
    bucket: list[tuple[int, int, int, int]] = []
    used = 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            length = min(size - offset, bucket_bytes - used)
            bucket.append((index, offset, used, length))
            offset += length
            used += length
            if used == bucket_bytes:
                yield bucket
                bucket, used = [], 0
    if bucket:
        yield bucket


def send(states: dict[str, Any], source: int, group: Any, device: Any,
         bucket_bytes: int | None = None) -> None:
    """The source's half: broadcast the skeleton, then the tensors' bytes."""
    skeleton, tensors = split(states)
    broadcast_bytes(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), source, group,
                    device)
    views = [_byte_view(tensor.detach().contiguous()) for tensor in tensors]
    _stream(views, source, group, device, bucket_bytes or BUCKET_BYTES, sending=True)


def receive(source: int, group: Any, device: Any,
            bucket_bytes: int | None = None) -> tuple[dict[str, Any], int]:
    """A receiver's half: (the rebuilt state dicts on the host, bytes received)."""
    import torch

    raw = broadcast_bytes(None, source, group, device)
    # The bytes come from a peer of this job over its own process group (torch's
    # object collectives unpickle the same way), and users' objects may hold more
    # than tensors.
    skeleton = pickle.loads(raw)  # noqa: S301
    wanted = slots(skeleton)
    tensors = [torch.empty(slot.shape, dtype=slot.dtype) for slot in wanted]
    views = [_byte_view(tensor) for tensor in tensors]
    _stream(views, source, group, device, bucket_bytes or BUCKET_BYTES, sending=False)
    return fill(skeleton, tensors), len(raw) + sum(slot.nbytes for slot in wanted)


def _byte_view(tensor: Any) -> Any:
    """A contiguous tensor's bytes as a flat uint8 tensor sharing its memory."""
    import torch

    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _stream(views: list[Any], source: int, group: Any, device: Any, bucket_bytes: int,
            sending: bool) -> None:
    """Broadcast the views' bytes back to back through one reused bucket buffer."""
    import torch
    import torch.distributed as dist

    total = sum(view.numel() for view in views)
    if total == 0:
        return
    buffer = torch.empty(min(total, bucket_bytes), dtype=torch.uint8, device=device)
    for bucket in buckets([view.numel() for view in views], bucket_bytes):
        used = bucket[-1][2] + bucket[-1][3]
        if sending:
            for index, offset, at, length in bucket:
                buffer[at:at + length].copy_(views[index][offset:offset + length])
        dist.broadcast(buffer[:used], src=source, group=group)
        if not sending:
            for index, offset, at, length in bucket:
                views[index][offset:offset + length].copy_(buffer[at:at + length])


def broadcast_bytes(payload: bytes | None, source: int, group: Any, device: Any) -> bytes:
    """The source's bytes on every member of `group`: the size first, then the bytes."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64,
                        device=device)
    dist.broadcast(size, src=source, group=group)
    if payload is not None:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=source, group=group)
    return payload if payload is not None else buffer.cpu().numpy().tobytes()
