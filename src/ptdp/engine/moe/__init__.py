"""Mixture-of-experts layers: the router (:mod:`.router`), the capacity decision (:mod:`.capacity`),
the balancing losses (:mod:`.losses`) and the experts (:mod:`.experts`)."""
