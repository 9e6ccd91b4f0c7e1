"""What a plan will do, before it runs: the cost model (``cost``), the fan-out of a mixture-of-experts block
(``fanout``) and the simulator (``simulate``)."""
