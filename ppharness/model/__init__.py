"""The model: GGUF files (synthetic and fetched), a stage's slice of the blocks on tinygrad, the unsplit oracle, and
bit-exactness checks.
"""
