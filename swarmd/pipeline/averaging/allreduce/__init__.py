"""The chunked all-reduce of a stage's gradients (issue #28): every peer owns the reduction of one part, so a
peer's traffic per round does not grow with the stage's size. ``averager`` has the protocol and its state
diagram; ``plan`` the pure decisions, ``coordinator``, ``member`` and ``owner`` the three roles,
``messages`` the wire messages, ``membership`` who counts toward a round's quorum."""
