"""The engine core, a subpackage per concern: `scheduling` (requests, schedulers, the
page allocator: plain Python), `loops` (what the engine's threads run), `programs`
(runners and the jitted programs), `compile` (warm-up, kept executables, background
compiles), `kv` (the prefill mesh's pool, the host tier, migration) and `multihost` (a
mesh across processes); at the top, the `Engine` that owns the threads, its
`Topology` and the elastic re-split."""
