"""Running a chain: the stage logic, the node process, membership, the orchestrator and the run locks."""
