"""Tensor parallelism: one engine's model split over worker processes (ranks).

`shard` cuts a loaded model into one rank's slice (attention by KV-head groups,
the feed-forward by its hidden units, a sum over the ranks after each output
projection); `ranks` starts the worker ranks and hands each of them the step the
scheduler made, which rank 0 (the engine's own process) computes with them.
Imports torch and the engine's model, never Ray or anything above the engine.
"""
