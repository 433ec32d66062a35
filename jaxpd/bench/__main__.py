"""`python -m jaxpd.bench`: see `jaxpd.bench.cli`."""
from jaxpd.bench.cli import main

main()
