"""Whether a router's replicas are alive, and how long the router waits on one.

A dead replica is easy: its port refuses connections. A *hung* one (a process stopped by SIGSTOP, stuck in
swap, or paused by a debugger) is not: the kernel still accepts TCP connections into the listen backlog,
and nothing ever answers. Waiting on it for a plain read timeout would hold a request for minutes, and a
short read timeout would cut healthy answers: a non-streaming reply sends its headers only once its last
token is computed, and a stream may pause while its prefill runs behind other requests' chunks.

So the router separates *slow* from *hung* by asking: whenever a reply has been silent for
``first_byte`` seconds (before its headers or first event) or ``stream_idle`` seconds (between two events
of a stream), it checks the replica's ``/health`` with a short ``health`` timeout. The server answers
/health from its event loop, which the engine's work does not block, so a replica that answers is working
and the wait goes on (up to ``read`` seconds of silence in all); one that does not is hung: it is marked
down, and the request is sent elsewhere if nothing reached the client yet, or its stream ended. A
background check every ``interval`` seconds finds hung replicas that hold no request and brings back the
ones that answer again (Kubernetes' liveness probes and Envoy's active health checks work the same way:
a probe with its own timeout, separate from the requests' timeouts).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from llmsys.serving.routing import Replica, Router


@dataclass(frozen=True)
class Timeouts:
    """Seconds the router waits (see the module docstring); ``python -m llmsys serve-router`` sets each."""

    connect: float = 2.0  # a TCP connection to a replica (a dead host, a full backlog)
    first_byte: float = 5.0  # silence before a reply's headers (or a stream's first event) that triggers a health check
    stream_idle: float = 10.0  # silence between two events of a stream that triggers a health check
    health: float = 2.0  # a /health answer; none within it: the replica is hung
    interval: float = 1.0  # between two background health checks of every replica
    read: float = 600.0  # the longest silence tolerated from a replica whose health checks pass

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if not v > 0}
        if bad:
            raise ValueError(f"router timeouts must be positive seconds; got {bad}")


class ReplicaHung(RuntimeError):
    """A replica stopped answering (its health check timed out) while a request waited on it."""


class ReplicaHealth:
    """Health checks of ``router``'s replicas over ``client``, and waits that give up on a hung replica."""

    def __init__(self, router: Router, client: httpx.AsyncClient, timeouts: Timeouts):
        self.router, self.client, self.timeouts = router, client, timeouts

    async def probe(self, replica: Replica) -> bool:
        """Ask the replica's /health: its state becomes up (200), draining (503) or down (no answer in time)."""
        try:
            reply = await self.client.get(replica.url + "/health", timeout=self.timeouts.health)
        except httpx.HTTPError as e:
            if replica.state != "down":
                self.router.mark_down(replica, f"{type(e).__name__}: {e}"[:120] or type(e).__name__)
            return False
        replica.state = "up" if reply.status_code == 200 else "draining"
        return True

    async def watch(self) -> None:
        """Check every replica every ``interval`` seconds, forever (a task the app cancels on shutdown)."""
        while True:
            await asyncio.gather(*(self.probe(r) for r in self.router.replicas))
            await asyncio.sleep(self.timeouts.interval)

    async def wait(self, awaitable, replica: Replica, patience: float):
        """The result of ``awaitable`` (a read from ``replica``), however long it takes while the replica
        passes a health check after each ``patience`` seconds of silence; raises ReplicaHung (the read
        cancelled) once it fails one, and httpx.ReadTimeout after ``read`` seconds in all."""
        task = asyncio.ensure_future(awaitable)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.read
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(patience, max(deadline - loop.time(), 0)))
                if done:
                    return task.result()
                if loop.time() >= deadline:
                    raise httpx.ReadTimeout(f"{replica.url} sent nothing for {self.timeouts.read:g} s")
                # the background check may have found it down already; else ask now, not at its next round
                if replica.state == "down" or not await self.probe(replica):
                    raise ReplicaHung(f"{replica.url} answered no health check within {self.timeouts.health:g} s "
                                      f"after {patience:g} s of silence")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
