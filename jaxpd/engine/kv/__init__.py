"""KV beyond the decode pool: the prefill mesh's own paged pool and prefix cache, the
host tier that keeps evicted prefix pages in host memory, and live migration, which
cuts decoding requests' KV out of the pool as handoffs."""
