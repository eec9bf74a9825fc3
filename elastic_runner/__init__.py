"""elastic-runner: an elastic, fault-tolerant launcher for PyTorch training."""

__version__ = "0.1.0"
