"""Checkpoints: the checkpointer (save, verify, publish, load the newest verified),
its storage on fsspec URLs, background writes, and the stores of the latest record."""
