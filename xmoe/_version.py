"""The package version, the one place it is written (pyproject.toml and xmoe.__version__ read it)."""

__version__ = "0.1.0"
