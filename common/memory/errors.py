class MemoryIntegrityError(RuntimeError):
    """A pool's bookkeeping is inconsistent: a leak, a double free or a corrupted index."""
