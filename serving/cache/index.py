"""The vector index: exact inner-product search (faiss `IndexFlatIP`), one per key.

Measured on this machine (2 shared cores, 576-dim random unit vectors, one query at a
time, a throwaway timing script): with 1,000 entries faiss's flat index searched in 0.09 ms
(p95 0.2 ms) and added all of them in 12 ms; usearch's HNSW searched in 0.44 ms (p95
4.7 ms) and took 508 ms to add them (31 s for 10,000). A cache's partitions hold
hundreds to a few thousand entries, where an exact scan is both faster and free of
recall loss, and entries come and go with every store and eviction, which a graph
index pays for at each add. hnswlib has no wheel for this Python (it compiles from
source), and would be a graph index again. So: faiss, flat, exact.

Vectors are unit length (engine/pooling.py normalizes them), so the inner product is
the cosine similarity.
"""

from __future__ import annotations

import itertools

import faiss
import numpy as np

faiss.omp_set_num_threads(1)
"""A search over one key's entries is a few thousand dot products: one thread. With
faiss's OpenMP team, bench_semantic_cache's miss overhead (4,096 entries over 64 keys)
was 20.1 ms p95 on the two shared cores; on one thread, 0.51 ms."""


class VectorIndex:
    """Entries' vectors by key: `nearest` searches only the entries of the query's key."""

    def __init__(self, dim: int | None = None) -> None:
        self._dim = dim
        self._partitions: dict[str, faiss.IndexIDMap2] = {}
        self._ids: dict[str, tuple[str, int]] = {}
        """Entry id -> (key, faiss id)."""
        self._entry_ids: dict[int, str] = {}
        self._next_id = itertools.count()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._ids

    def add(self, key: str, entry_id: str, vector: np.ndarray) -> None:
        """Index `vector` under `key`; an entry already indexed is left as it is."""
        if entry_id in self._ids:
            return
        row = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1)  # [1, dim]
        if self._dim is None:
            self._dim = row.shape[1]
        if row.shape[1] != self._dim:
            raise ValueError(f"vector has {row.shape[1]} dimensions; the index holds {self._dim}")
        partition = self._partitions.get(key)
        if partition is None:
            partition = self._partitions[key] = faiss.IndexIDMap2(faiss.IndexFlatIP(self._dim))
        faiss_id = next(self._next_id)
        partition.add_with_ids(row, np.array([faiss_id], dtype=np.int64))
        self._ids[entry_id] = (key, faiss_id)
        self._entry_ids[faiss_id] = entry_id

    def remove(self, entry_ids: list[str]) -> None:
        """Forget entries (unknown ids are ignored); an emptied key's index goes too."""
        for entry_id in entry_ids:
            found = self._ids.pop(entry_id, None)
            if found is None:
                continue
            key, faiss_id = found
            del self._entry_ids[faiss_id]
            partition = self._partitions[key]
            partition.remove_ids(np.array([faiss_id], dtype=np.int64))
            if partition.ntotal == 0:
                del self._partitions[key]

    def nearest(self, key: str, vector: np.ndarray) -> tuple[str, float] | None:
        """The entry of `key` most similar to `vector`, and the cosine similarity; None
        when the key has no entry."""
        partition = self._partitions.get(key)
        if partition is None:
            return None
        row = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1)
        if row.shape[1] != self._dim:
            return None
        similarities, faiss_ids = partition.search(row, 1)
        return self._entry_ids[int(faiss_ids[0, 0])], float(similarities[0, 0])
