"""Tensor parallelism: the plan (tp_plan.py), sharded models (tp_shard.py), ranks (tp_group.py)."""
