"""The paged KV cache: block allocator, the KVCache seam, full-precision and quantized caches, page pool, profiles."""
