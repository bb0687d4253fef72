"""How a stage's peers average their gradients and step together (SWARM, section 3.2), and what keeps a
stranger's contribution from steering the mean.

- ``averager``: the stage's averaging task (:class:`~swarmd.pipeline.averaging.averager.StageAverager`),
  with one leader per round: ``leader`` and ``contributor`` are its two sides, ``round`` what both share,
  ``patience`` how long a round waits, ``reduction`` the leader's reduction.
- ``allreduce/``: the chunked all-reduce (reduce-scatter + all-gather with one atomic decision), whose
  traffic per peer does not grow with the stage's size; the protocol's state diagram is in
  ``allreduce.averager``.
- ``trust/``: the checks of contributions and of leaders: refusals, robust aggregation, conviction of
  hostile contributions and accusations, openings of contributions and recomputation of a microbatch.
- ``error_feedback`` and ``codec_choice``: compressed averaging (the residual sent next time; the codec
  chosen from each link's measured speed).
"""
