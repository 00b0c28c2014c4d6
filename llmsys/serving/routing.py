"""Which replica serves a request: the one whose KV cache holds the longest prefix of its prompt, unless
the replicas' loads differ too much; or round-robin, the baseline.

The router cannot look inside the replicas' caches, so it keeps its own approximate record of them, as
SGLang's cache-aware router keeps an approximate radix tree per worker: the chained block hashes
(``blocks.prefix_hashes``, the very hashes a replica's prefix cache indexes its full blocks by) of every
prompt it sent to each replica, the least recently sent dropped first once a record holds as many
blocks as the replica's KV cache (the replica evicts its free cached blocks in that order too). A hash
chains on every block before it, so a prompt's cached prefix is the longest run of its *leading* hashes
found in a record: one set lookup per block, no tree to walk. The record is approximate: a replica may
have evicted blocks still on record (busy blocks push cached ones out), and a replica that restarts
loses everything, which is why the router forgets a replica's record when it finds it dead.

The choice, SGLang's rule (sgl-router, now SMG: defaults cache threshold 0.3, balance thresholds 64
requests and 1.5x; the absolute one is scaled down here to replicas running tens of requests):

1. the loads are *imbalanced* when max - min > ``balance_abs`` and max > ``balance_rel`` x min:
   the least loaded replica takes the request, whatever it has cached;
2. else the replica with the longest cached prefix, if that prefix covers more than
   ``cache_threshold`` of the prompt;
3. else the least loaded (ties: the smallest record, the most room for a new prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmsys.serving.blocks import prefix_hashes

POLICIES = ("prefix", "round-robin")


class NoReplica(RuntimeError):
    """Every replica is dead, draining or already refused this request."""


@dataclass(eq=False)  # a replica is itself, not its fields' values
class Replica:
    url: str
    capacity_blocks: int = 512  # the replica's --kv-blocks: how much its record may hold
    state: str = "up"  # "up", "draining" (its /health says 503: finishing, taking nothing new) or "down"
    in_flight: int = 0  # requests this router has sent it that have not ended
    record: OrderedDict = field(default_factory=OrderedDict)  # prefix hash -> None, least recently sent first
    why_down: str = ""

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) this replica holds, by the record."""
        n = 0
        while n < len(hashes) and hashes[n] in self.record:
            n += 1
        return n

    def remember(self, hashes: Sequence[int]) -> None:
        """The replica took a prompt with these blocks: they are its most recently used now."""
        for h in hashes:
            self.record[h] = None
            self.record.move_to_end(h)
        while len(self.record) > self.capacity_blocks:
            self.record.popitem(last=False)


@dataclass
class Choice:
    replica: Replica
    reason: str  # "prefix", "balance" (loads imbalanced), "load" (no prefix worth following), "round-robin"
    matched_tokens: int


class Router:
    """The policy over a fixed list of replicas (see the module docstring)."""

    def __init__(self, replicas: list[Replica], policy: str = "prefix", block_size: int = 16,
                 cache_threshold: float = 0.3, balance_abs: int = 8, balance_rel: float = 1.5):
        if policy not in POLICIES:
            raise ValueError(f"no routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if block_size < 1 or any(r.capacity_blocks < 1 for r in replicas):
            raise ValueError(f"block size ({block_size}) and replica KV blocks "
                             f"({', '.join(str(r.capacity_blocks) for r in replicas)}) must be positive: the replicas' "
                             "--block-size and --kv-blocks")
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold is a share of the prompt, in 0..1; got {cache_threshold}")
        self.replicas, self.policy, self.block_size = replicas, policy, block_size
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.turn = 0  # round-robin's position

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        return prefix_hashes(tokens, self.block_size)

    def choose(self, tokens: Sequence[int], hashes: Sequence[int], exclude=()) -> Choice:
        """The replica for a prompt of ``tokens`` (``hashes``: its chained block hashes), never one in
        ``exclude`` (those that already refused or failed it). Raises NoReplica when none is left."""
        candidates = [r for r in self.replicas if r.state == "up" and r not in exclude]
        if not candidates:
            raise NoReplica(self.describe(exclude))
        # a replica computes a prompt's last token whatever it holds (its logits pick the next token), so
        # a block ending at that token never counts as a hit there (BlockManager.add)
        hashes = hashes[:max(len(tokens) - 1, 0) // self.block_size]
        if self.policy == "round-robin":
            self.turn += 1
            replica = candidates[self.turn % len(candidates)]
            return Choice(replica, "round-robin", replica.cached_blocks(hashes) * self.block_size)
        least = min(candidates, key=lambda r: (r.in_flight, len(r.record)))
        loads = [r.in_flight for r in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return Choice(least, "balance", least.cached_blocks(hashes) * self.block_size)
        best = max(candidates, key=lambda r: (r.cached_blocks(hashes), -r.in_flight))
        matched = best.cached_blocks(hashes) * self.block_size
        if tokens and matched / len(tokens) > self.cache_threshold:
            return Choice(best, "prefix", matched)
        return Choice(least, "load", least.cached_blocks(hashes) * self.block_size)

    def mark_down(self, replica: Replica, why: str) -> None:
        """A replica that failed a connection: route nothing to it, and forget its record (a process that
        comes back has an empty cache)."""
        replica.state, replica.why_down = "down", why
        replica.record.clear()

    def describe(self, exclude=()) -> str:
        """Why no replica can take a request, one clause per replica."""
        parts = []
        for r in self.replicas:
            why = (f"down ({r.why_down})" if r.state == "down" else "draining" if r.state == "draining"
                   else "refused this request (busy)" if r in exclude else "up")
            parts.append(f"{r.url} is {why}")
        return "no replica can take the request: " + "; ".join(parts)
