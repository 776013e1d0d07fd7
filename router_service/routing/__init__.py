"""Routing policies, expert-prefetch predictors and routing statistics (below `actors`, above `kernels`)."""
