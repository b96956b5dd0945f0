"""Typed experiment configs (experiment.py) and dotted config keys (paths.py)."""
