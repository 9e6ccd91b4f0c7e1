"""The planner: which devices run the model, in which order and which blocks each runs (``planner``), by the exact
search (``exact``) and the heuristic (``heuristic``) over the instance (``instance``), minimising the objective
(``objective``) within a time limit (``budget``)."""
