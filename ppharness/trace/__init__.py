"""Per-token, per-hop timing: recording spans in a stage, and turning them into records, summaries and trace files."""
