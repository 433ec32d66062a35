"""The engine core: schedulers and page allocator (plain Python), runners (jitted
programs), the prefill and decode loops, and the `Engine` that owns their threads."""
