"""Averaging among strangers (issues #17, #29): what a stage's averaging does with contributions it cannot take
on trust. ``refusals`` and ``round_checks`` turn away malformed and outlying contributions and check the
leader; ``robust_aggregation`` bounds any one contribution's influence on the mean; ``hostile_contributions``
scores contributions that keep pulling against the stage and ``accusations`` / ``accuser`` make a conviction
checkable by stage-mates; ``contribution_proofs``, ``openings`` and ``recomputation`` hold a contribution to
the microbatches it claims."""
