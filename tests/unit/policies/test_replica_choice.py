"""Replica choice in a pool: slots and KV first, prefix affinity while cheap, no starving."""

from __future__ import annotations

from policies.replica_choice import (
    ChoiceSettings,
    PrefixAffinity,
    ReplicaLoad,
    prefix_hashes,
    rank_replicas,
)

SETTINGS = ChoiceSettings(kv_cache_full=0.9, affinity_max_imbalance=0.5)


def load(replica_id: str, running: int = 0, waiting: int = 0, kv: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(replica_id, running, waiting, max_num_seqs=4, kv_cache_usage=kv)


def rank(
    *loads: ReplicaLoad,
    unknown: tuple[str, ...] = (),
    preferred: str | None = None,
    settings: ChoiceSettings = SETTINGS,
) -> list[list[str]]:
    return rank_replicas(loads, unknown, preferred, settings)


def test_free_batch_slots_rank_before_a_full_batch() -> None:
    ranks = rank(load("busy", running=4), load("idle"))
    assert ranks == [["idle"], ["busy"]]


def test_waiting_requests_count_against_a_replica() -> None:
    ranks = rank(load("a", running=1, waiting=2), load("b", running=2))
    assert ranks == [["b"], ["a"]]


def test_kv_pressure_ranks_a_replica_with_free_slots_lower() -> None:
    ranks = rank(load("kv", running=1, kv=0.7), load("slots", running=2))
    assert ranks == [["slots"], ["kv"]]


def test_a_replica_with_full_kv_counts_as_full_despite_free_slots() -> None:
    ranks = rank(load("kv", kv=0.95), load("slots", running=3))
    assert ranks == [["slots"], ["kv"]]


def test_equal_replicas_share_one_rank_so_serve_balances_between_them() -> None:
    ranks = rank(load("a", running=1), load("b", running=1), load("c"))
    assert ranks == [["c"], ["a", "b"]]


def test_replicas_without_stats_rank_after_known_room_and_before_full_ones() -> None:
    ranks = rank(load("full", running=4), load("free"), unknown=("new",))
    assert ranks == [["free"], ["new"], ["full"]]


def test_only_unknown_replicas_are_still_all_routable() -> None:
    assert rank(unknown=("a", "b")) == [["a", "b"]]


def test_prefix_affinity_wins_while_its_replica_has_room_and_is_not_much_busier() -> None:
    ranks = rank(load("idle"), load("holder", running=2), preferred="holder")
    assert ranks == [["holder"], ["idle"]]


def test_prefix_affinity_yields_to_balance_when_its_replica_is_much_busier() -> None:
    ranks = rank(load("idle"), load("holder", running=3), preferred="holder")
    assert ranks == [["idle"], ["holder"]]


def test_prefix_affinity_yields_when_its_replica_is_full() -> None:
    lenient = ChoiceSettings(affinity_max_imbalance=1.0)
    ranks = rank(
        load("a", running=4), load("holder", running=4), preferred="holder", settings=lenient
    )
    assert ranks == [["a", "holder"]]


def test_affinity_to_a_replica_without_stats_is_ignored() -> None:
    assert rank(load("a"), unknown=("holder",), preferred="holder") == [["a"], ["holder"]]


def test_a_live_count_above_the_snapshot_is_counted_as_waiting() -> None:
    snapshot = load("a", running=1)
    assert snapshot.with_ongoing(3) == load("a", running=1, waiting=2)
    assert snapshot.with_ongoing(0) == snapshot
    assert snapshot.with_ongoing(None) == snapshot


def test_prefix_hashes_are_chained_per_full_block() -> None:
    shared = list(range(8))
    a = prefix_hashes(shared + [100, 101, 102, 103, 7], block_size=4, max_blocks=8)
    b = prefix_hashes(shared + [200, 201, 202, 203], block_size=4, max_blocks=8)
    assert len(a) == len(b) == 3  # the partial block of `a` is not hashed
    assert a[:2] == b[:2] and a[2] != b[2]
    assert prefix_hashes(shared, block_size=4, max_blocks=1) == a[:1]
    assert prefix_hashes([1, 2, 3], block_size=4, max_blocks=8) == []


def test_prefix_hashes_depend_on_earlier_blocks() -> None:
    a = prefix_hashes([1, 1, 2, 2], block_size=2, max_blocks=2)
    b = prefix_hashes([3, 3, 2, 2], block_size=2, max_blocks=2)
    assert a[1] != b[1]


def test_affinity_finds_the_replica_of_the_longest_remembered_prefix() -> None:
    affinity = PrefixAffinity(max_prefixes=16)
    system = prefix_hashes(list(range(8)), block_size=4, max_blocks=4)
    longer = prefix_hashes(list(range(12)), block_size=4, max_blocks=4)
    affinity.record(system, "a")
    affinity.record(longer, "b")
    assert affinity.lookup(longer) == "b"
    assert affinity.lookup(longer[:1] + [12345]) == "b"  # block 0 was last served by b
    assert affinity.lookup([999]) is None


def test_affinity_forgets_the_least_recently_used_prefixes() -> None:
    affinity = PrefixAffinity(max_prefixes=2)
    affinity.record([1], "a")
    affinity.record([2], "b")
    assert affinity.lookup([1]) == "a"  # now 2 is the least recent
    affinity.record([3], "c")
    assert len(affinity) == 2
    assert affinity.lookup([2]) is None
    assert affinity.lookup([1]) == "a" and affinity.lookup([3]) == "c"
