"""The distributed debugger: ``breakpoint()`` on a rank, pdb prompts in the notebook.

- :mod:`.server` (worker side): a :class:`pdb.Pdb` whose input and output
  travel over the control channel as ``debug`` / ``debug_input`` messages;
  installed as ``sys.breakpointhook`` and ``pdb.set_trace`` in every worker.
- :mod:`.registry` (controller side): which ranks are paused, and where.
- :mod:`.console` (controller side): the ``(Pdb rank R)`` and
  ``(mesh-debug)`` prompts (list / attach / cast / continue / quit).

The kernel connects the console to Jupyter's stdin channel in
:mod:`monarch_kernel.kernel.debug_bridge`.
"""
