"""Test and demo helpers shipped with Relax: a local elastic Ray cluster with fake autoscaled nodes.

Importing this package is cheap (no Ray import); Ray loads when a cluster starts or is inspected.
"""

from relax.testing.elastic_cluster import (
    ClusterInfo,
    ClusterStatus,
    ElasticCluster,
    ElasticClusterConfig,
    ElasticClusterError,
    NodeStatus,
    PendingGang,
    read_status,
    stop_cluster,
)

__all__ = [
    "ClusterInfo",
    "ClusterStatus",
    "ElasticCluster",
    "ElasticClusterConfig",
    "ElasticClusterError",
    "NodeStatus",
    "PendingGang",
    "read_status",
    "stop_cluster",
]
