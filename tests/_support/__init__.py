"""Helpers shared by the test packages (importable as ``_support``: ``tests/conftest.py``'s folder is on
``sys.path`` under pytest's default import mode)."""
