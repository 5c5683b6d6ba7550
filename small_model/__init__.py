"""The small model, made offline: distillation (`distill/`), the prompt sets,
answer checks and labels the difficulty router is fitted on, and its report.

Serving reads only what this produces (the published student, configs/router.json),
never imports it. May import: engine, policies, bench.prompts.
"""
