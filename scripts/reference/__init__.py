"""Checks of our code against the reference implementations' own code (scripts/reference/*.py)."""
