"""One long-running daemon per machine, and its parts (see ``lifecycle.py`` for the start-up and
shutdown order): ``joining.py`` (address, model, stage), ``stage_state.py`` (the served stage's
state in and out), ``announcing.py`` (what it tells the swarm and reads back), ``relaying.py``
(reachability and relays), ``views.py`` (``/status``, ``/swarm``); ``host.py`` is what the parts
may use of the daemon."""

from swarmd.daemon.lifecycle import Daemon

__all__ = ["Daemon"]
