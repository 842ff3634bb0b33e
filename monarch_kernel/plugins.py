"""The rank-side plug-ins a worker process loads: the features above the worker core.

The worker package never imports a feature. This module, the worker
process's composition root (``python -m monarch_kernel worker`` imports it
before it runs :func:`monarch_kernel.worker.worker.main`), plugs them in:

* the remote debugger is imported at once: its start hook installs
  ``breakpoint()`` before the worker serves;
* the other features register their handlers when their modules are
  imported, and those modules are loaded on the first message that needs
  them (:func:`monarch_kernel.worker.handlers.register_deferred`), so a worker
  that only runs cells never pays for importing the actor layer.

=========================  ==========================================================
module                     messages it handles on a rank
=========================  ==========================================================
debug.server               ``debug_input`` (I/O thread); start hook: remote pdb
actor.host                 ``call``, ``calls``, ``rank_dead`` (I/O thread);
                           ``spawn_actor``, ``stop_actor``
actor.peers                ``keys`` (I/O thread); peer lanes shared with the worker's I/O
tensors.store              ``free`` (I/O thread); ``ref``; keeps ``.rref()`` results
mesh.dist_setup            ``setup`` (torch.distributed)
=========================  ==========================================================
"""

from __future__ import annotations

from monarch_kernel.debug import server as debug_server
from monarch_kernel.worker import handlers

__all__ = ["DEFERRED", "EAGER"]

#: imported with the worker: what must act before the first message
EAGER = (debug_server,)

#: message types -> the modules whose import registers their handlers. Actor calls
#: load the tensor store too: a call's ``.rref()`` result is kept there.
DEFERRED: dict[tuple[str, ...], tuple[str, ...]] = {
    ("call", "calls", "rank_dead", "spawn_actor", "stop_actor", "keys", "ref", "free"): (
        "monarch_kernel.actor.host", "monarch_kernel.actor.peers",
        "monarch_kernel.tensors.store"),
    ("setup",): ("monarch_kernel.mesh.dist_setup",),
}

for _types, _modules in DEFERRED.items():
    handlers.register_deferred(_types, _modules)
