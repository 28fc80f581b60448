"""Tensor parallelism's building blocks, what model code uses: the rank group (`group`), the sharded layers
(`layers`) and which shard of heads, vocabulary and weights a rank holds (`partition`). The rank processes that
build and run the model are common/ranks."""
