"""The semantic cache at the ingress: a chat request that asks again, in other words,
what a stored deterministic request asked is answered with the stored answer.

`config` (its settings), `request_key` (what must match exactly, what is compared by
meaning), `index` (the vector index: faiss), `entries` (an entry and the store
interface), `memory_store` / `redis_store` (the two backends: one replica's memory, or
shared through Redis), `replay` (a stored answer as a response or an SSE stream),
`semantic_cache` (lookup and store, metrics), `calibration` (the threshold from
paraphrase and near-miss pairs). May import: engine, policies, serving's http shapes.
"""
