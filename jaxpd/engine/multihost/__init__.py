"""One role's mesh across processes: the plan channel between a leader and its
followers, the prefill and decode plans they replay, and per-shard KV offers."""
