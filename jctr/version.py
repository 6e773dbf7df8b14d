"""The jctr version (one place; bundles and checkpoints record it)."""

__version__ = "0.1.0"
