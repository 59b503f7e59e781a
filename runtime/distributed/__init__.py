"""Processes that run one engine together: tensor-parallel ranks, their start-up and
the watch over them (the model's sharding is model/parallel.py)."""
