"""Local Docker: the provider, the node image it builds, and the run's bridge network."""
