#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite: unit (no I/O),
# integration (a real etcd started on free loopback ports) and e2e (real agents
# and gloo workers on localhost). Extra arguments go to pytest. Two pytest workers:
# e2e tests mostly wait on real processes; every test starts its own etcd on free
# ports. --dist worksteal: xdist's default ("load") hands each worker its first quarter
# of the tests in collection order, so one worker got every e2e test and the other sat
# idle for 9 of the 13 minutes; a worker that runs dry now takes half of the other's
# queue (9 min instead of 13 on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/debian_etcd.sh  # etcd 3.4 beside the wheel's 3.5, where apt can fetch it
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
