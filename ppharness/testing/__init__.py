"""ppharness for pytest: the ``ppharness`` plugin (``plugin.py``), loaded wherever ppharness is installed."""
