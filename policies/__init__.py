"""Pure request policies: tiers, routing, admission and rate limits (no Ray, no torch)."""
