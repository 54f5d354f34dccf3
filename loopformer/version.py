"""The package version (recorded in checkpoints, dataset and corpus manifests)."""

__version__ = "0.1.0"
