"""A user's own training loop under Regatta's runtime: Horovod's elastic API (``init``,
``DistributedOptimizer``, ``elastic.run``, ``TorchState``) with the runtime behind it.
``regatta.horovod`` is the public face; see session.py."""
