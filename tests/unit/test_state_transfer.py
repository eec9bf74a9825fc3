"""state_transfer without a peer: what goes into the skeleton, what travels as bytes,
and how the byte stream is cut into buckets. The broadcasts themselves run between
real gloo ranks in tests/integration/test_state_transfer.py."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from elastic_runner.worker.state_transfer import TensorSlot, buckets, fill, slots, split

Pair = collections.namedtuple("Pair", "first second")


def round_trip(states):
    """What a receiver rebuilds: the pickled skeleton filled with copies of the bytes."""
    skeleton, tensors = split(states)
    skeleton = pickle.loads(pickle.dumps(skeleton))
    received = []
    for slot, tensor in zip(slots(skeleton), tensors):
        assert (slot.shape, slot.dtype) == (tuple(tensor.shape), tensor.dtype)
        copy = torch.empty(slot.shape, dtype=slot.dtype)
        copy.reshape(-1).view(torch.uint8).copy_(
            tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        received.append(copy)
    return skeleton, fill(skeleton, received)


def test_every_dense_tensor_becomes_a_slot_and_the_rest_stays_in_the_skeleton():
    weight = torch.arange(6.0).reshape(2, 3)
    states = {"step": 7, "objects": {
        "model": collections.OrderedDict(weight=weight, bias=torch.zeros(2)),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "sampler": {"epoch": 1, "seen": [1, 2], "pair": Pair(torch.ones(1), "x")},
        "tag": ("a", None)}}
    skeleton, rebuilt = round_trip(states)
    assert [slot.index for slot in slots(skeleton)] == [0, 1, 2, 3]
    assert isinstance(skeleton["objects"]["model"]["weight"], TensorSlot)
    assert skeleton["objects"]["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    model = rebuilt["objects"]["model"]
    assert type(model) is collections.OrderedDict and list(model) == ["weight", "bias"]
    assert torch.equal(model["weight"], weight) and torch.equal(model["bias"], torch.zeros(2))
    assert rebuilt["objects"]["optimizer"]["state"][0]["step"].item() == 3.0
    pair = rebuilt["objects"]["sampler"]["pair"]
    assert type(pair) is Pair and pair.second == "x" and torch.equal(pair.first, torch.ones(1))
    assert rebuilt["step"] == 7 and rebuilt["objects"]["tag"] == ("a", None)


@pytest.mark.parametrize("tensor", [
    torch.tensor(2.5),                                   # 0-dim
    torch.empty(0, 4),                                   # no elements
    torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
    torch.tensor([True, False, True]),
    torch.randn(5).to(torch.bfloat16),
    torch.randn(3, dtype=torch.complex64),
    torch.nn.Parameter(torch.randn(2, 2)),               # keep_vars=True state dicts
], ids=["0-dim", "empty", "transposed", "bool", "bfloat16", "complex", "parameter"])
def test_a_tensor_of_any_shape_and_dtype_arrives_bit_for_bit(tensor):
    _, rebuilt = round_trip({"t": tensor})
    got = rebuilt["t"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor.detach())


def test_a_sparse_tensor_travels_pickled_in_the_skeleton():
    sparse = torch.eye(3).to_sparse()
    skeleton, tensors = split({"s": sparse, "d": torch.ones(2)})
    assert len(tensors) == 1 and skeleton["s"] is sparse


def test_the_byte_stream_is_cut_into_buckets_that_tensors_may_span():
    cut = list(buckets([10, 0, 25, 3], bucket_bytes=16))
    # (tensor, offset in tensor, offset in bucket, length)
    assert cut == [[(0, 0, 0, 10), (2, 0, 10, 6)],
                   [(2, 6, 0, 16)],
                   [(2, 22, 0, 3), (3, 0, 3, 3)]]
    for bucket in cut:
        assert sum(length for *_, length in bucket) <= 16
    assert list(buckets([0, 0], 16)) == [] and list(buckets([16], 16)) == [[(0, 0, 0, 16)]]


def test_a_slot_knows_its_bytes():
    assert TensorSlot(0, (3, 4), torch.float16).nbytes == 24
    assert TensorSlot(0, (), torch.int64).nbytes == 8
    assert TensorSlot(0, (0, 5), torch.float32).nbytes == 0
