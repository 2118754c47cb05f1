"""The ``speculant`` command."""
