"""torchrun's `etcd-v3` rendezvous backend, built on EtcdRendezvous.

Why: torch's own etcd backends speak the etcd v2 API (gone from etcd 3.4 on by
default, removed in 3.6) and its c10d backend keeps the control plane in one
node's TCPStore. This plugs our v3 protocol (leases for liveness, one watch per
agent, transactional round closing) into an unmodified torchrun:

    torchrun --rdzv-backend etcd-v3 --rdzv-endpoint HOST:2379[,HOST2:2379] \
             --rdzv-id JOB --nnodes 1:4 --rdzv-conf lease_ttl=5,settle=2 ...

`--rdzv-conf` keys (all optional; values arrive as strings):
  lease_ttl      node lease TTL, s (5): a dead node is noticed within this time
  settle         s (2): once --nnodes' minimum joined, close after this long
                 with no new node
  settle_max     s (30): longest a stream of arrivals holds a round open
  suspect_grace  s (1): how long a round opened on a suspicion waits for the
                 previous members (torch's agent never raises one today)
  join_timeout   s: rendezvous gives up below the minimum after this long;
                 default: `timeout`, which torchrun always sets (900 unless
                 --rdzv-timeout / rdzv-conf timeout says otherwise)
  store_timeout  s (300, c10d's default): blocking reads of the agents' store
  etcd_timeout   s (5): deadline of one etcd call
  node_id        (HOST-PID-RANDOM): must be unique per agent of one run
  local_addr     address workers use for MASTER_ADDR when this node hosts rank 0;
                 --local-addr wins; default socket.getfqdn(), like torch's c10d
  master_port    fixed port for the workers' TCPStore (default: a free port)
  nproc          this node's worker count, recorded in the job spec (default 1)
  cacert, cert, key   TLS files for etcd

Numbers follow the launcher's rules (validation.NUMBER_BOUNDS): a value out of
range is refused with the line `elastic-run` prints for its flag, naming the key
(`--rdzv-conf lease_ttl 0: need at least 1 second`), as an RdzvConfError, which
torch sees as the ValueError it expects from a handler's creation.

The job spec every agent of a run must agree on is (min nodes, max nodes,
nproc, "torchrun"): torch's parameters carry neither the worker count nor the
script, so agents can only be checked as far as --nnodes (and `nproc` when set).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError, RendezvousConnectionError, RendezvousError, RendezvousHandler,
    RendezvousInfo, RendezvousParameters, RendezvousStateError, RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_runner.ids import id_problem
from elastic_runner.config import DEFAULT_ETCD_TIMEOUT_S, EtcdConfig, RendezvousConfig
from elastic_runner.errors import (
    ConfigError, ElasticRunError, EtcdError, LeaseLost, RendezvousTimeout, RunFinished,
    ShutdownRequested, WorkerFailure,
)
from elastic_runner.etcd.client import EtcdClient, parse_endpoint
from elastic_runner.rendezvous import protocol as p
from elastic_runner.rendezvous.engine import EtcdRendezvous
from elastic_runner.rendezvous.torch_store import EtcdStore
from elastic_runner.validation import (
    Bound, check_bound, check_number, check_tls_files, sanitize_id, settle_cap,
)

log = logging.getLogger(__name__)

BACKEND = "etcd-v3"
# torch's parameters do not carry the script, so every torchrun job shares this.
FINGERPRINT = "torchrun"
# torchrun counts worker failures against --max-restarts itself and this handler
# never reports one, so the protocol's own restart limit is never reached.
_MAX_RESTARTS_UNUSED = 0
KNOWN_CONFIG = {"lease_ttl", "settle", "settle_max", "suspect_grace", "join_timeout", "timeout",
                "store_timeout", "etcd_timeout", "node_id", "local_addr", "master_port", "nproc",
                "cacert", "cert", "key"}
# The one key without a launcher flag; c10d's rendezvous uses the same default.
STORE_TIMEOUT = Bound("store_timeout", "--rdzv-conf store_timeout",
                      lambda v: v > 0 and v != float("inf"), "a positive number of seconds")


class RdzvConfError(ConfigError, ValueError):
    """A --rdzv-conf value or torchrun parameter is wrong: a ConfigError, with the launcher's
    text, and a ValueError, which is what torch expects a handler's creation to raise."""


@contextmanager
def rdzv_conf_errors() -> Iterator[None]:
    """Re-raise the shared checks' ConfigError as RdzvConfError."""
    try:
        yield
    except RdzvConfError:
        raise
    except ConfigError as exc:
        raise RdzvConfError(str(exc)) from exc


@contextmanager
def torch_errors() -> Iterator[None]:
    """Re-raise our errors as the RendezvousError subclasses torch's agent expects."""
    try:
        yield
    except RendezvousTimeout as exc:
        raise RendezvousTimeoutError(str(exc)) from exc
    except (RunFinished, WorkerFailure, ShutdownRequested) as exc:
        raise RendezvousClosedError(str(exc)) from exc
    except EtcdError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    except LeaseLost as exc:
        raise RendezvousStateError(str(exc)) from exc
    except ElasticRunError as exc:  # SpecMismatch and the rest: wrong setup, not transient
        raise RendezvousError(str(exc)) from exc


class EtcdV3RendezvousHandler(RendezvousHandler):
    """One agent's view of a run; torch's agent calls it from one thread.

    A node is one member of a plan: rank = its node rank, world size = the number
    of member nodes (torch's agent derives worker ranks from these via the store).
    Workers bootstrap their own TCPStore on the plan's master address and port,
    so `use_agent_store` stays False: the etcd store is the agents' alone.
    """

    def __init__(self, client: EtcdClient, config: RendezvousConfig, spec: p.JobSpec,
                 store_timeout: timedelta):
        self._client = client
        self._config = config
        self._store_timeout = store_timeout
        self._rdzv = EtcdRendezvous(client, config, spec, _MAX_RESTARTS_UNUSED)
        self._registered = False
        self._plan: p.Plan | None = None
        self._change: p.Cause | None = None  # why the current plan stopped holding
        self._shut_down = False

    @property
    def plan(self) -> p.Plan | None:
        return self._plan

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._config.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        with torch_errors():
            if not self._registered:
                self._rdzv.register()
                self._registered = True
            plan = self._rdzv.next_plan(self._plan, self._cause())
        self._plan, self._change = plan, None
        log.info("%s: %s", self._config.node_id, plan.describe())
        member = plan.member(self._config.node_id)
        store = EtcdStore(self._client, p.store_prefix(self._config.prefix, plan.round),
                          self._store_timeout)
        return RendezvousInfo(store, member.node_rank, len(plan.members),
                              RendezvousStoreInfo(plan.master_addr, plan.master_port))

    def _cause(self) -> p.Cause:
        """What the next round's key records as the reason it opened."""
        if self._plan is None:
            return p.Cause(p.CauseKind.START)
        return self._change or p.Cause(p.CauseKind.OTHER, "torchrun restarted the workers")

    def num_nodes_waiting(self) -> int:
        """>0 once the current plan no longer holds: torch then re-rendezvouses.

        The count is 1 whatever the cause (newcomer, lost member, expired lease):
        torch only compares it with 0. An etcd outage answers 0, because healthy
        workers should keep training through it; a lost lease shows up here later.
        """
        if self._plan is None:
            return 0
        try:
            reason = self._rdzv.change_reason(self._plan)
        except EtcdError as exc:
            log.warning("cannot check round %d's membership (%s); keeping the workers",
                        self._plan.round, exc)
            return 0
        if reason is None:
            return 0
        if reason != self._change:
            log.info("round %d no longer holds: %s", self._plan.round, reason)
        self._change = reason
        return 1

    def is_closed(self) -> bool:
        """Read from etcd rather than the mirror: it may be asked before joining."""
        with torch_errors():
            kv = self._client.get(p.round_key(self._config.prefix))
        return kv is not None and p.RoundState.from_json(kv.value).state in (p.FINISHED, p.FAILED)

    def set_closed(self) -> None:
        """Mark the round finished, so late agents stop instead of re-forming it.

        Only a round this node is a member of can be finished (the protocol's
        rule); before the first rendezvous there is nothing to close.
        """
        if self._plan is None or not self._registered:
            log.info("set_closed before any rendezvous: nothing to close")
            return
        with torch_errors():
            self._rdzv.finish(self._plan)

    def shutdown(self) -> bool:
        """Leave now: revoking the lease lets the others re-form without the TTL wait.

        Idempotent: the launcher's `finally` may follow an explicit shutdown.
        """
        if self._shut_down:
            return True
        self._shut_down = True
        self._rdzv.shutdown.set()
        try:
            if self._registered:
                self._rdzv.leave()
            return True
        except EtcdError as exc:
            log.warning("leaving run %r failed (%s); peers will see the lease expire",
                        self._config.run_id, exc)
            return False
        finally:
            self._client.close()


# ---- the creator torchrun calls ---------------------------------------------------
def _number(params: RendezvousParameters, key: str, default: float | None,
            whole: bool = False) -> float | None:
    """--rdzv-conf values arrive as strings; programmatic callers may pass numbers.
    `whole`: the launcher's flag is an integer (argparse refuses 1.5 there too)."""
    value = params.get(key)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RdzvConfError(f"--rdzv-conf {key}={value!r} is not a number") from None
    if whole:
        if not number.is_integer():
            raise RdzvConfError(f"--rdzv-conf {key}={value!r} is not a whole number")
        return int(number)
    return number


def _checked(params: RendezvousParameters, key: str, default: float | None,
             dest: str | None = None, whole: bool = False) -> float | None:
    """A --rdzv-conf number, checked against the launcher's bound for the same setting."""
    value = _number(params, key, default, whole)
    return check_number(dest or key, value, f"--rdzv-conf {key}")


def _default_node_id() -> str:
    """Unique per agent process, even for several agents on one host."""
    return sanitize_id(f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}", "node")


def etcd_config(params: RendezvousParameters, lease_ttl_s: int) -> EtcdConfig:
    """How this agent reaches etcd; `lease_ttl_s` (its lease) sets the retry deadline."""
    endpoints = tuple(e.strip() for e in (params.endpoint or "").split(",") if e.strip())
    if not endpoints:
        raise RdzvConfError("--rdzv-endpoint is empty: give the etcd endpoint(s) as "
                            "HOST:PORT[,HOST:PORT] or http(s)://HOST:PORT")
    with rdzv_conf_errors():
        for endpoint in endpoints:
            parse_endpoint(endpoint)
        check_tls_files(params.get("cacert"), params.get("cert"), params.get("key"))
        timeout = _checked(params, "etcd_timeout", DEFAULT_ETCD_TIMEOUT_S)
    return EtcdConfig.build(endpoints, timeout, lease_ttl_s=lease_ttl_s,
                            cacert=params.get("cacert"), cert=params.get("cert"),
                            key=params.get("key"))


def rendezvous_config(params: RendezvousParameters) -> RendezvousConfig:
    """torchrun's parameters, checked by the launcher's rules (RdzvConfError if not)."""
    node_id = str(params.get("node_id") or _default_node_id())
    for what, value in (("--rdzv-id", params.run_id), ("--rdzv-conf node_id", node_id)):
        problem = id_problem(value)
        if problem:
            raise RdzvConfError(f"{what} {problem}")
    with rdzv_conf_errors():
        given_join = params.get("join_timeout") not in (None, "")
        join_timeout = _checked(params, "join_timeout" if given_join else "timeout", 600.0,
                                dest="join_timeout")
        settle = _checked(params, "settle", 2.0)
        settle_max = settle_cap(settle, _checked(params, "settle_max", None),
                                ("--rdzv-conf settle", "--rdzv-conf settle_max"))
        return RendezvousConfig(
            run_id=params.run_id, node_id=node_id,
            min_nodes=params.min_nodes, max_nodes=params.max_nodes,
            lease_ttl_s=_checked(params, "lease_ttl", 5, whole=True),
            join_timeout_s=join_timeout, settle_s=settle, settle_max_s=settle_max,
            suspect_grace_s=_checked(params, "suspect_grace", 1.0),
            node_addr=params.local_addr or params.get("local_addr") or socket.getfqdn(),
            master_port=_checked(params, "master_port", None, whole=True),
            nproc=_checked(params, "nproc", 1, whole=True),
        )


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Build a handler from torchrun's parameters; bad values raise RdzvConfError (a
    ValueError) before anything touches etcd."""
    unknown = sorted(set(params.config) - KNOWN_CONFIG)
    if unknown:
        log.warning("ignoring unknown --rdzv-conf keys for %s: %s", BACKEND, ", ".join(unknown))
    rdzv = rendezvous_config(params)
    spec = p.JobSpec(params.min_nodes, params.max_nodes, FINGERPRINT)
    with rdzv_conf_errors():
        store_timeout = timedelta(seconds=check_bound(
            STORE_TIMEOUT, _number(params, "store_timeout", 300.0)))
    config = etcd_config(params, rdzv.lease_ttl_s)
    with torch_errors():
        client = EtcdClient(config)
    return EtcdV3RendezvousHandler(client, rdzv, spec, store_timeout)


def plugin() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch calls it and registers the result."""
    return create_handler
