"""Benchmarks (tools, never imported by the engine): `python -m jaxpd.bench` runs the
serving bench (`cli`) over workloads (`workload`) driven on the wall clock (`driver`),
against transformers (`hf`); `roofline`, `layerwise` and `transfer` time one part each.
`args` holds the flag parsers the bench and `jaxpd.plan` share."""
