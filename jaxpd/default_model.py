"""The built-in default model shipped inside the package."""
from __future__ import annotations

import os

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def default_model_dir() -> str:
    """Path of the Hugging Face-format checkpoint used when no model is given."""
    if not os.path.isfile(os.path.join(_DIR, "config.json")):
        raise FileNotFoundError(f"the built-in default model is missing from {_DIR}; "
                                f"reinstall jaxpd or pass a checkpoint directory")
    return _DIR
