"""Ops chosen by shape, dtype and hardware. Each fast path has a plain-torch reference beside it."""
