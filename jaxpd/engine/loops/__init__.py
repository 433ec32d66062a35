"""The loops the engine's threads call: prefill batches, prefill with context into
decode slots, and decode steps. None owns a thread."""
