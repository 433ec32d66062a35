"""Deciding what runs (plain Python, no jax): the live requests and their inboxes, the
prefill and decode schedulers, the page allocator with its prefix cache, and the
bucket arithmetic every program shape comes from."""
