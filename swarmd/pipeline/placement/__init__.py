"""Which peer serves which stage, and from what state (SWARM, section 3.3): ``rebalance`` (which stage a peer
should serve), ``migration`` (moving a live peer, and the rebalance loop), ``claims`` (newcomers started at
once), ``coverage`` (every stage's health), ``resume`` and ``state_sync`` (where a stage's state comes from,
and from which stage-mate it is downloaded)."""
