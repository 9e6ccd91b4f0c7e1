"""Decoding over the engine: the greedy rules every stage and the oracle share (``rules``), the oracle, the drafts
of speculative decoding, the bit-exactness verdict of a split, and kernel tuning."""
