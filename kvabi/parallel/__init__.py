"""Tensor parallelism's plan (tp_plan.py) and a rank's shard of a model (tp_shard.py); the ranks
run in kvabi/engine (tp_group.py, tp_worker.py)."""
