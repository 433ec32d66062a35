"""`python -m jaxpd.plan`: see `jaxpd.plan.planner`."""
from jaxpd.plan.planner import main

main()
