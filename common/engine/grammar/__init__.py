"""Constrained decoding: the xgrammar backend (compile, cache), one request's grammar state, the batch's
token bitmask. docs/structured-output.md has the design."""
