"""`python -m jaxpd.client`: the command-line client, `jaxpd.serving.client`."""
from absl import app

from jaxpd.serving.client import define_flags, main

if __name__ == "__main__":
    define_flags()
    app.run(main)
