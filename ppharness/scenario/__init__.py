"""Scenario YAML: the typed document, the limits its YAML must keep, and its one-line error messages."""
