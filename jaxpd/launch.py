"""`python -m jaxpd.launch`: the server launcher, `jaxpd.serving.launch`."""
from absl import app

from jaxpd.serving.launch import define_flags, main

if __name__ == "__main__":
    define_flags()
    app.run(main)
