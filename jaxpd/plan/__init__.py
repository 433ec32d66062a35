"""DistServe-style placement (a tool, never imported by the engine): `python -m jaxpd.plan`
profiles (`profile`), fits latency models and simulates every split (`simulator`), and
ranks them by goodput (`planner`)."""
