"""Running a chain, in rooms (``tests/test_architecture.py`` holds their floors, lowest first):

- ``loop``, ``reliable``, ``membership``: what every actor shares (the one message loop, the outbox that resends until
  acknowledged, failure detection);
- ``stage/``: a stage of the chain (its record, receipt, admission, scheduler, send path, replays, speculative windows);
- ``node/``: the process a provider starts (``pp-node``, ``pp-host``), which serves a stage or an expert bank;
  ``inprocess``: a whole chain of stages in one process;
- ``seed/``: the orchestrator (the session, the client, failover and replan, the plan realised as node specs, the
  directory and the roles, run locks).
"""
