"""The model: synthetic specs and their GGUF writer, fetched files, the architectures (``arch``), a stage's slice of the
blocks on tinygrad, the unsplit oracle, and bit-exactness checks.
"""
