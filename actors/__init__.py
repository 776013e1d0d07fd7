"""One rank of the expert-parallel cluster: model forward for its expert shard, paged KV cache,
dispatch/combine, scheduler and the Ray actor class."""
