"""Built-in collective-backend plugins: ``nccl``, ``gloo``, ``mccl`` and the default selector.

They are registered through the same hooks as third-party backends; each is
its own plugin, so ``MT_DISABLED_PLUGINS=nccl`` removes NCCL like any other.
"""
