"""The Ray Serve application: how requests reach the engines.

`http/` (the OpenAI surface: ingress, schemas, errors, streaming, the gateway),
`pools/` (engine replicas, their monitor, replica choice and scaling),
`batch/` (OpenAI Batch API jobs), `telemetry`, `config` and `app_config`
(the validated YAML), `app` (the app builder `serve run` calls).
May import: engine, policies, Ray. Never small_model's training code, bench or testing.
"""
