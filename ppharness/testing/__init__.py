"""Tools that exercise a run rather than run one: the whole chain in one process, injected node faults, background runs
watched line by line, and which backends this machine can test.
"""
