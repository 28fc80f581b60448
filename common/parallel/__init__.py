"""Tensor parallelism inside one server: the rank processes, their process group, the sharded layers and
the per-step broadcast from rank 0 (see docs/architecture.md, "Ranks")."""
