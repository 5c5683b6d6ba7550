"""Pure request policies on the hot path: tiers, placement, latency prediction,
replica choice, scaling, rate limits, model routing.

Plain functions over plain data, so they are unit-tested without a cluster and
cheap to call per request. May import: the standard library only.
Never torch, Ray, or any other tierserve package.
"""
