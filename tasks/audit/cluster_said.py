"""What a cluster's scheduler says of its workers, read once into typed values (``tasks.audit.cluster``,
``flows.scheduler``): Ray's node list (``ray.nodes()``) and a Dask scheduler's identity (``Client.scheduler_info()``,
``Scheduler.identity``). This module alone reads their keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RayNode:
    """A node of a Ray cluster: its ``node_id``, the ``address`` it was started with, the ``gpus`` it offers and
    whether it is ``alive`` (Ray lists the nodes that died too)."""

    node_id: str
    address: str
    gpus: float
    alive: bool


def ray_nodes(listed: list[dict]) -> list[RayNode]:
    """The nodes ``ray.nodes()`` lists."""
    return [RayNode(node["NodeID"], node["NodeManagerAddress"], node["Resources"].get("GPU", 0), node["Alive"])
            for node in listed]


@dataclass(frozen=True)
class DaskWorker:
    """A worker of a Dask cluster: its ``address`` and the ``gpus`` it offers (its ``GPU`` resource)."""

    address: str
    gpus: float


def dask_workers(identity: dict) -> list[DaskWorker]:
    """The workers a Dask scheduler's identity lists."""
    return [DaskWorker(address, about.get("resources", {}).get("GPU", 0))
            for address, about in identity["workers"].items()]
