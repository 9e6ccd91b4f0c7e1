"""Who runs what: block ranges per stage, stage names and the plan each node receives."""
