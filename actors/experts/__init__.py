"""Packed routed experts of one rank: `cache` (dequantized expert cache, eviction clock), `cold_tier` (packed
experts read on demand from the checkpoint), `worker` (prefetch thread), `ops` (kernel choice), `packed` (one
layer's experts), `prediction` + `runtime` (the rank's runtime and model hooks), `build`, `calibration`,
`checkpoint`."""
