"""The plan language: the typed document and its canonical form (``document``), the bounds on what it may hold
(``limits``) and the index it finds records by (``lookup``), its compact text form (``text_form``, read by
``parse``) and its invariants (``check``, with what a plan asks of its devices in ``devices``)."""
