"""The trainer side of SWARM: the corpus it samples microbatches from, and the loop around it."""
