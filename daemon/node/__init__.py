"""The node: wires the engine, the cluster, tensor groups and shards into one daemon's
serving core (:class:`Node`, configured by :class:`NodeConfig`)."""

from ringlet.daemon.node.config import NodeConfig
from ringlet.daemon.node.core import Node

__all__ = ["Node", "NodeConfig"]
