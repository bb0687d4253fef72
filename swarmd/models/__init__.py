"""The architectures a stage can be built from: ``gpt``, ``llama``, and registered ones.

:mod:`swarmd.models.base` is the stage every architecture shares (deterministic init, input
checks, layer sharing, the loss); :mod:`~swarmd.models.gpt` and :mod:`~swarmd.models.llama`
fill in its pieces; :mod:`~swarmd.models.registry` finds an architecture by the spec's ``arch``,
including ones another package registers under the ``swarmd.models`` entry-point group.
"""
