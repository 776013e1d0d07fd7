"""Bringing up and running the expert-parallel group of Ray actors."""
from cluster.config import ClusterConfig
from cluster.launcher import EPCluster

__all__ = ["ClusterConfig", "EPCluster"]
