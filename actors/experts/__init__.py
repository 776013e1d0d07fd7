"""Packed routed experts of one rank: `cache` (dequantized expert cache and the eviction choice), `cold_tier`
(packed experts read on demand from the checkpoint), `worker` (prefetch thread), `packed` (one layer's experts),
`prediction` + `runtime` (the rank's runtime and model hooks), `build` (builders), `calibration`, `checkpoint`."""
