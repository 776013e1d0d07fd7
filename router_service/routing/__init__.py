"""Offline routing work: fitting expert predictors (log-linear, lookahead, prequential), calibration, aggregation."""
