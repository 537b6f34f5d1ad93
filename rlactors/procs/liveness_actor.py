"""Liveness: a tiny actor beside the real one in a proc, which answers the pings of
rlactors.procs.liveness.ProcWatcher on its own thread (the trainer serves its calls one at a time, so
it could not answer one while it trains)."""

from __future__ import annotations

import os
from typing import Any

from monarch.actor import Actor, endpoint

from rlactors.procs.liveness import ProcWatcher, WatchedProc, this_machine


class Liveness(Actor):
    @endpoint
    async def ping(self) -> dict[str, Any]:
        return {"machine": this_machine(), "pid": os.getpid()}


async def watch_procs(watcher: ProcWatcher, procs: Any, names: list[str]) -> list[WatchedProc]:
    """Spawns a Liveness actor on every proc of `procs` (a proc mesh, ranks in order) and watches
    each one under its name in `names`."""
    liveness = procs.spawn("liveness", Liveness)
    points = [point for point, _ in (await liveness.ping.call()).items()]
    if len(points) != len(names):
        raise ValueError(f"{len(names)} names for the {len(points)} procs of {procs}")
    return [await watcher.watch(name, liveness.slice(**dict(point)).ping.call_one)
            for name, point in zip(names, points)]
