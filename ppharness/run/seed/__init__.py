"""The orchestrator, the run's seed: ``orchestrator.Chain`` over the session (``session``: provisioning, the seed's
endpoint, its loop, teardown), the client (``client``), failover (``failover``, ``replan``) and the observer
(``observe``); the plan realised as node specs (``realise``), who joined (``directory``), each message checked against
its sender's role (``roles``), and which runs are alive (``locks``)."""
