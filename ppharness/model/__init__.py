"""The model, in floors that only look down (``docs/architecture.md``): ``formats`` (ggml weight formats), ``gguf``
(the file format as data), ``text`` (tokenizers), ``layers`` (what blocks are built of on tinygrad), ``arch`` (one
module per architecture), ``held``/``support`` (what a stage holds, what a file may ask), ``synthetic`` (synthetic
models), ``sources`` (where a file comes from), ``gguf_file``/``verdict`` (a file read; will it load), ``engine`` (a
stage's slice and its device step), ``decode`` (greedy rules, the oracle, drafts, exactness, tuning).
"""
