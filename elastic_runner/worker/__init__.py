"""What runs inside the training process: `er.init`, the sampler and batch policy,
the step boundary, checkpoints, `er.report`.

It may import torch and the shared modules (contract, config, errors, events), and
`etcd` only for the checkpoint record; never `agent` or `cli`. The public names are
re-exported lazily by `elastic_runner/__init__.py`.
"""
