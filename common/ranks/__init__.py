"""The rank processes of tensor parallelism inside one server: rank 0's side (`ranks`, `leader`), the followers,
their launch, the nodes of a group spanning machines (`node`, `node_board`, `remote_nodes`), progress, the
per-step broadcast and each rank's model and pool (see docs/tensor-parallel.md). The building blocks the
models use are common/parallel, which never imports this package."""
