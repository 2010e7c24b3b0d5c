"""The training core: a 3D-parallel PyTorch loop that checkpoints through the store.

What ``trainer/`` and ``monitoring/`` use of the store. The public face first: every name on
``ckpt.__all__`` is imported from ``ckpt`` (the checkpointers and their options, the
errors, ``EventBus``, ``Storage``, ``init_distributed`` ...). For what the face does not
carry, these sub-packages, and no other (``tests/ckpt/test_layers.py`` reads this list and
holds both packages to it; never ``ckpt.cli``, whose commands are the operator's):

* ``ckpt.cadence``: the interval grammar the ``[checkpoint]`` config checks, and the goodput
  ledger and failure history that the trainer writes and monitoring turns into metrics.
* ``ckpt.dcp``: the state conventions a loop shares with the store's save and load (the
  optimizer's state per parameter, ``read_from`` for a Hugging Face import).
* ``ckpt.errors``: shared vocabulary: the one-line error format of every command line.
* ``ckpt.events``: shared vocabulary: the event kinds and fields the trainer emits and
  monitoring reads.
* ``ckpt.export``, ``ckpt.hf``: the Hugging Face folder's names and its reader
  (``trainer.hf``'s import and export).
* ``ckpt.format``: a step folder's name, and the tensor codec ``trainer.ft``'s wire sends
  state in.
* ``ckpt.job``: the node's local root of a two-tier job (``node_local_root``).
* ``ckpt.ranks``: the one way ranks decide together (``Agreement``), the store's CPU
  groups, and the Slurm job the lease names (``SlurmJob``).
* ``ckpt.root``: ``trainer.ft`` extends the root's write lease and fence to replica groups.
"""
