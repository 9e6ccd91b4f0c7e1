"""WAN emulation: the fault vocabulary (``spec``), one link's seeded behaviour (``shaper``) and the layers that
apply it to a run."""
