"""Which ranks form a node: the ranks that share one shard cache folder (its fetches, its room).
Found through ``torch.distributed`` by gathering each rank's cache folder, named by its host and
its real path; never from the host alone (two launchers on one host with their own ``TMPDIR``
keep two caches: two nodes).
"""
from __future__ import annotations

import os
import socket

from ..engine import process_group


def cache_nodes(folder: str) -> list[tuple[str, str]] | None:
    """Every rank's cache folder as (host, real path), in rank order, gathered from all ranks
    (a collective: every rank calls it); None without ``torch.distributed``."""
    dist = process_group()
    if dist is None:
        return None
    mine = (socket.gethostname(), os.path.realpath(folder))
    folders: list = [None] * dist.get_world_size()
    dist.all_gather_object(folders, mine)
    return [tuple(found) for found in folders]
