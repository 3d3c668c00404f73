"""The maskc release: a leaf module, so every layer (and pyproject.toml) reads it without
importing the package's public surface."""

__version__ = "0.1.0"
