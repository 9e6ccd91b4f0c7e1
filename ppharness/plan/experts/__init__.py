"""The expert planner: where a mixture-of-experts model's routed experts run (``place``), over its problem and lower
bound (``problem``) and its local search (``local_search``); and measured expert frequencies into a plan
(``routing``)."""
