"""`elastic-run notice`: tell a running node it is about to be reclaimed.

For setups where the reclaim warning arrives somewhere other than the agent's
own process (a cloud metadata watcher, an operator's shell): the notice goes
through etcd, and the node's agent treats it exactly like a SIGTERM notice.
"""

from __future__ import annotations

import argparse
import json

from elastic_runner.cli.flags import ETCD_TIMEOUT, add_flags, parse_checked, parse_endpoints
from elastic_runner.config import EtcdConfig
from elastic_runner.errors import ConfigError, RendezvousError
from elastic_runner.rendezvous import protocol as p
from elastic_runner.validation import check_id, check_number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-run notice", allow_abbrev=False,
                                     description="Give one node of a run a spot notice.")
    parser.add_argument("--rdzv-endpoints", required=True, help="etcd v3 URLs of the run")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--node-id", required=True, help="the node that will be reclaimed")
    add_flags(parser, (ETCD_TIMEOUT,))
    return parser


def send_notice(client, run_id: str, node_id: str) -> int:
    """Write notice/<node_id> for the current round; return that round."""
    prefix = p.run_prefix(run_id)
    current = client.get(p.round_key(prefix))
    if current is None:
        raise RendezvousError(f"run {run_id!r} has no round in etcd: check --run-id and that it runs")
    if client.get(p.node_key(prefix, node_id)) is None:
        raise RendezvousError(f"node {node_id!r} is not a live member of run {run_id!r}; "
                              "`elastic-run status` lists the nodes")
    number = p.RoundState.from_json(current.value).number
    client.put(p.notice_key(prefix, node_id), json.dumps({"round": number, "from": "cli"}).encode())
    return number


def main(argv: list[str], environ: dict[str, str]) -> int:
    from elastic_runner.agent.launch import connect

    args = parse_checked(build_parser(), argv)
    check_id(args.run_id, "--run-id")
    check_id(args.node_id, "--node-id")
    check_number("etcd_timeout", args.etcd_timeout)
    endpoints = parse_endpoints(args.rdzv_endpoints)
    if not endpoints:
        raise ConfigError("--rdzv-endpoints is empty: give the etcd URLs the run uses")
    client = connect(EtcdConfig.build(endpoints, args.etcd_timeout))
    try:
        number = send_notice(client, args.run_id, args.node_id)
    finally:
        client.close()
    print(f"notice sent to node {args.node_id} of run {args.run_id} (round {number})")
    return 0
