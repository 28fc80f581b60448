"""HiCache's third tier: a KV store every server shares (`--hicache-storage-backend file|mooncake`), behind the
host tier (common/memory/hicache.py). Design: docs/kv-store.md."""
