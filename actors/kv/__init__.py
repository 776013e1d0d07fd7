"""The paged KV cache: block allocator, full-precision and quantized caches, page pool, profiles."""
