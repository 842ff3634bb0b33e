"""The rank-side plug-ins a worker process loads: the features above the worker core.

Importing this module imports each feature's rank-side module, which
registers its message handlers (and start hooks) with the worker
(:mod:`monarch_kernel.worker.handlers`). ``python -m monarch_kernel worker``
imports it before it runs :func:`monarch_kernel.worker.worker.main`; the
worker package itself never imports a feature.

=========================  ==========================================================
module                     messages it handles on a rank
=========================  ==========================================================
actor.host                 ``call``, ``calls`` (I/O thread); ``spawn_actor``, ``stop_actor``
actor.peers                ``keys`` (I/O thread); peer lanes the I/O poll watches
tensors.store              ``free`` (I/O thread); ``ref``
debug.server               ``debug_input`` (I/O thread); start hook: remote pdb
mesh.dist_setup            ``setup`` (torch.distributed)
=========================  ==========================================================
"""

from __future__ import annotations

from monarch_kernel.actor import host as actor_host
from monarch_kernel.actor import peers as actor_peers
from monarch_kernel.debug import server as debug_server
from monarch_kernel.mesh import dist_setup
from monarch_kernel.tensors import store as tensor_store

__all__ = ["RANK_PLUGINS"]

#: the rank-side modules loaded in every worker process (imported above)
RANK_PLUGINS = (actor_host, actor_peers, tensor_store, debug_server, dist_setup)
