"""The OpenAI-compatible HTTP surface: the ingress deployment, request and
response schemas, field checks, errors, SSE streaming and the API-key gateway."""
