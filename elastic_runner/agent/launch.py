"""Wires the pieces for one node: etcd (given or embedded), client, agent."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from elastic_runner.agent.agent import Agent
from elastic_runner.config import AgentConfig, EtcdConfig
from elastic_runner.errors import ConfigError, EtcdError
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.etcd.server import EmbeddedEtcd

log = logging.getLogger("elastic_runner")


def connect(config: EtcdConfig) -> EtcdClient:
    """Open a client and prove the endpoint is etcd (a plain HTTP server is not)."""
    client = EtcdClient(config)
    try:
        version = client.server_version()
    except EtcdError:
        client.close()
        raise
    log.debug("etcd %s at %s", version, ",".join(config.endpoints))
    return client


def launch(config: AgentConfig, environ: dict[str, str]) -> int:
    with contextlib.ExitStack() as stack:
        etcd_config = config.etcd
        if not etcd_config.endpoints:
            server = stack.enter_context(EmbeddedEtcd(binary=etcd_config.binary))
            log.info("started embedded etcd at %s (data in %s)", server.endpoint, server.data_dir)
            etcd_config = dataclasses.replace(etcd_config, endpoints=(server.endpoint,))
        log.info("run id: %s", config.rendezvous.run_id)
        client = connect(etcd_config)
        stack.callback(client.close)
        agent = Agent.on_etcd(config, client, etcd_config, environ)
        stack.callback(agent.close)
        if config.metrics_port is not None:
            from elastic_runner.agent.metrics import start_metrics_server

            try:
                server = start_metrics_server(config.metrics_port, agent.progress_dir,
                                              config.metrics_addr)
            except OSError as exc:
                raise ConfigError(
                    f"--metrics-port {config.metrics_port} on --metrics-addr "
                    f"{config.metrics_addr}: cannot listen ({exc.strerror or exc}); pick "
                    "another port, or 0 for any free one") from None
            agent.events.subscribe(server.observe)
            stack.callback(server.stop)
            log.info("metrics at http://%s:%d/metrics", server.host, server.port)
        agent.install_signal_handlers()
        return agent.run()
