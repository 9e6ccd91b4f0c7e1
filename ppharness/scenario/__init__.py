"""Scenario YAML: the typed document and its loading (``schema``), its sections (``sections``) and what is known of
its model before anything runs (``facts``)."""
