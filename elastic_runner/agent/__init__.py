"""The agent: one long-lived process per node (`elastic-run`).

It joins rounds through `rendezvous/`, starts and stops this node's workers, drains
them on a notice, and exports metrics. It never imports torch; it may import
`rendezvous`, `etcd` and the shared modules (contract, config, errors, events),
never `cli` or `worker`.
"""
