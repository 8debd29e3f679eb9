"""``hvd.elastic`` of regatta.horovod: ``run``, ``TorchState``, ``ObjectState`` and
Horovod's own ``ElasticSampler`` (tracked by a state, it re-partitions at every reset)."""
from horovod.torch.elastic import ElasticSampler

from elastic.userloop.session import run
from elastic.userloop.state import ObjectState, TorchState

__all__ = ["run", "TorchState", "ObjectState", "ElasticSampler"]
