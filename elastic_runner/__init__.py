"""elastic-runner: an elastic, fault-tolerant launcher for PyTorch training.

The worker-side API (see examples/train_mlp.py)::

    import elastic_runner as er
    with er.init() as ctx:
        sampler = er.ElasticSampler(n, global_batch_size=64)
        ckpt = er.Checkpointer("/shared/ckpt", keep=3, every=50)
        ...

Workers that survive a resize in their own process (examples/train_inproc.py)::

    ctx = er.init(defer_group=True)   # the group forms at train(): changes meanwhile are free
    state = er.State(model=model, optimizer=opt, sampler=sampler)
    state.restore(ckpt)

    @er.elastic(state)
    def train(state):
        ...                 # called again after every in-process re-formation
    train()

Names resolve lazily so the agent (`elastic-run`) never pays for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "init": "worker.runtime", "finish": "worker.runtime", "current": "worker.runtime",
    "Context": "worker.runtime", "Checkpointer": "worker.job_checkpointer",
    "EXIT_FOR_RESIZE": "worker.runtime", "report": "worker.runtime",
    "CheckpointError": "worker.checkpoint.checkpointer",
    "StaleWriterError": "worker.checkpoint.checkpointer",
    "MemoryLatestStore": "worker.checkpoint.checkpointer",
    "ElasticSampler": "worker.sampler", "ElasticDataLoader": "worker.data_loader",
    "SamplerDrawnAhead": "errors",
    "State": "worker.state", "ShardedStateError": "worker.state", "elastic": "worker.elastic",
    "NoPlaceYet": "errors",
    "BatchPolicy": "worker.scaling", "BatchPlan": "worker.scaling",
    "parse_policy": "worker.scaling", "plan_batch": "worker.scaling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"elastic_runner.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'elastic_runner' has no attribute {name!r}")
