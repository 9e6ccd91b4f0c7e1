"""The process a provider starts: ``main`` (``pp-node``) picks what it serves, ``node`` a stage or an expert bank from
its Join to its exit, with its inputs (``env``, ``address``), the directory it takes from the seed (``members``), the
faults it injects (``faults``), the expert fan-out and expert nodes (``experts``), warm standbys (``standby``),
co-located stages in one process (``colocated``) and several nodes on one machine (``host``: ``pp-host``)."""
