"""Fixtures shared by the rendezvous integration tests."""

from __future__ import annotations

import pytest

from tests.helpers.rdzv_nodes import Node


@pytest.fixture
def node(etcd):
    """Start a Node in run `run` (`begin=False`: only connect it); all are stopped after."""
    made: list[Node] = []

    def start(run: str, node_id: str, max_nodes: int, begin: bool = True, **options) -> Node:
        made.append(Node(etcd.endpoint, run, node_id, max_nodes, **options))
        return made[-1].start() if begin else made[-1]

    yield start
    for each in made:
        each.stop()
