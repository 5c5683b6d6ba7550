"""Benchmarks and load tools, run by hand (`python -m bench.<layer>.<name>`).

`engine/` (in-process engine speed), `serving/` (through the server),
`traffic/` (locust, soak), `eval/` (quality). `report` prints the JSON lines
every benchmark reports; `prompts` makes synthetic prompts.
May import: everything but tests (testing/ for the local cluster is fine).
"""
