"""A pipeline stage as one peer serves it: ``runtime`` (executor + averager, swapped as one), ``executor``
and its one ``worker`` thread running the ``passes`` (forward, backward) and the ``updates`` (gradients in
and out, the optimizer step, the state), by the ``step_protocol``; ``delayed_updates``, the
``activation_cache``, ``precision``, the ``optimizer`` and its ``optimizer_state``."""
