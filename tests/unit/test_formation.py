"""The timeout a re-formed round's group is created with (worker/formation.py).

gloo waits five timeouts for a peer's first connection; a peer that posted its
address and then died held survivors 30 s at a 6 s formation timeout, out of reach
of any call-off. The group's timeout is therefore a fifth of the formation timeout
for gloo, so the worst wait is the formation timeout itself.
"""

from __future__ import annotations

import pytest

from elastic_runner.worker import formation


@pytest.mark.parametrize("backend, formation_s, init_s", [
    ("gloo", 6.0, 1.2),                 # --lease-ttl 3: the connect gives up after 6 s
    ("gloo", 20.0, 4.0),
    ("cpu:gloo,cuda:nccl", 10.0, 2.0),  # gloo is in it: the same 5x wait
    ("gloo", 2.0, 1.0),                 # never below the floor: the store waits need a moment
    ("nccl", 6.0, 6.0),                 # no such factor: unchanged
])
def test_gloo_groups_are_formed_with_a_fifth_of_the_formation_timeout(backend, formation_s,
                                                                        init_s):
    got = formation.init_timeout_s(backend, formation_s)
    assert got == pytest.approx(init_s)
    if "gloo" in backend and formation_s / formation.GLOO_CONNECT_FACTOR >= 1.0:
        assert got * formation.GLOO_CONNECT_FACTOR == pytest.approx(formation_s)
