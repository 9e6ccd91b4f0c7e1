"""Synthetic models: what one is (``spec``), its vocabulary (``vocab``) and the GGUF writer (``writer``), which draws
each tensor through its architecture."""
