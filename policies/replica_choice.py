"""Which replica of a pool serves a request: free batch slots, KV headroom, prefix-cache affinity.

Pure: replica loads in, ranked replica ids out (serving/pools/replica_choice.py
is the Ray glue). The answer is ranks, not one pick: Serve tries the ranks in
order and, within a rank, takes the replica with the shortest live queue, so
equally loaded replicas share a burst instead of all of it landing on one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's engine load, as its last routing stats reported it."""

    replica_id: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_cache_usage: float
    """Fraction of KV blocks in use (0..1)."""

    @property
    def pressure(self) -> float:
        """The scarcer of batch slots and KV blocks, as the fraction in use (1 means full)."""
        return max((self.num_running + self.num_waiting) / self.max_num_seqs, self.kv_cache_usage)

    def has_room(self, kv_cache_full: float) -> bool:
        """A new request would join the running batch at once instead of queueing."""
        num_seqs = self.num_running + self.num_waiting
        return num_seqs < self.max_num_seqs and self.kv_cache_usage < kv_cache_full

    def with_ongoing(self, num_ongoing: int | None) -> ReplicaLoad:
        """This load corrected by a live count of the requests the replica holds.

        Stats are a snapshot taken once a period; a router's count of requests
        it sent and that have not finished is live. When that count is larger,
        the difference arrived after the snapshot and is counted as waiting.
        """
        extra = (num_ongoing or 0) - self.num_running - self.num_waiting
        return replace(self, num_waiting=self.num_waiting + extra) if extra > 0 else self


@dataclass(frozen=True)
class ChoiceSettings:
    """How the choice trades load balance against prefix-cache hits."""

    kv_cache_full: float = 0.95
    """KV usage at which a replica counts as full even with free batch slots."""
    affinity_max_imbalance: float = 0.5
    """How much more pressure than the least loaded replica a prefix's replica may carry
    and still get the request: a cache hit saves prefill, not a wait behind a busy batch."""


def rank_replicas(
    loads: Sequence[ReplicaLoad],
    unknown_ids: Sequence[str],
    preferred_id: str | None,
    settings: ChoiceSettings,
) -> list[list[str]]:
    """Every replica id given, once, in ranks best first; replicas in one rank are equals.

    1. `preferred_id` (the replica that holds the request's prefix) alone,
       while it has room and is not much busier than the least loaded replica.
    2. Replicas with room, least pressure first.
    3. Replicas without stats (just started, or their stats call failed):
       never starved, but not trusted over a replica known to have room.
    4. Full replicas, least pressure first: the request queues somewhere.
    """
    preferred = _affine(loads, preferred_id, settings)
    rest = [load for load in loads if load is not preferred]
    with_room = [load for load in rest if load.has_room(settings.kv_cache_full)]
    full = [load for load in rest if not load.has_room(settings.kv_cache_full)]
    ranks = [[preferred.replica_id]] if preferred is not None else []
    ranks += _by_pressure(with_room)
    ranks += [list(unknown_ids)] if unknown_ids else []
    return ranks + _by_pressure(full)


def _affine(
    loads: Sequence[ReplicaLoad], preferred_id: str | None, settings: ChoiceSettings
) -> ReplicaLoad | None:
    """The preferred replica's load, when affinity to it should win over balance."""
    preferred = next((load for load in loads if load.replica_id == preferred_id), None)
    if preferred is None or not preferred.has_room(settings.kv_cache_full):
        return None
    least = min(load.pressure for load in loads)
    return preferred if preferred.pressure - least <= settings.affinity_max_imbalance else None


def _by_pressure(loads: Sequence[ReplicaLoad]) -> list[list[str]]:
    """Replica ids grouped by equal pressure, least first."""
    ranks: dict[float, list[str]] = {}
    for load in sorted(loads, key=lambda load: load.pressure):
        ranks.setdefault(load.pressure, []).append(load.replica_id)
    return list(ranks.values())


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's leading full blocks, shortest prefix first.

    Hash i covers blocks 0..i, as in the engine's prefix cache, so two prompts
    share hash i exactly when they share their first i + 1 blocks. Integer
    tuples hash the same in every process (no string salt), so the hashes of
    routers on different nodes agree.
    """
    hashes: list[int] = []
    parent = 0
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    for start in range(0, num_blocks * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixAffinity:
    """Which replica last served each prompt prefix, for the most recent `max_prefixes` prefixes.

    A bounded LRU: a replica's prefix cache evicts old blocks too, so an old
    entry is worth little and the table never grows with traffic.
    """

    def __init__(self, max_prefixes: int) -> None:
        self._max_prefixes = max_prefixes
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, hashes: Sequence[int]) -> str | None:
        """The replica that last served the longest of these prefixes, if one is remembered."""
        for prefix in reversed(hashes):
            replica_id = self._owner.get(prefix)
            if replica_id is not None:
                self._owner.move_to_end(prefix)
                return replica_id
        return None

    def record(self, hashes: Sequence[int], replica_id: str) -> None:
        """Remember that `replica_id` now holds every one of these prefixes."""
        for prefix in hashes:
            self._owner[prefix] = replica_id
            self._owner.move_to_end(prefix)
        while len(self._owner) > self._max_prefixes:
            self._owner.popitem(last=False)
