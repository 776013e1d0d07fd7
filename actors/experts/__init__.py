"""Packed routed experts of one rank: expert cache, cold tier, prefetch worker, runtime, builders."""
