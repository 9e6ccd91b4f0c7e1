"""Who runs what: block ranges per stage, stage names and the plan each node receives.

The rooms, lowest first (``tests/test_architecture.py`` holds the order): ``lang`` (the plan language: the typed
document, its bounds, its text form and its invariants); ``graph``, ``stages``, ``build`` and ``provenance`` (a
model's graph, stage ranges and names, chains built in code, what a device was measured with); ``reader`` (the one
reader of every plan and cluster file: JSON, YAML and the text form); ``compile`` (a plan made ready to run) and
``predict`` (the cost model and the simulator); ``search`` (the planner) and ``experts`` (the expert planner); and
above them ``show``, ``validation``, ``consumer`` and ``speculation_gain``.
"""
