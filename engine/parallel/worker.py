"""A tensor-parallel worker rank's process: `python -m engine.parallel.worker READ_FD WRITE_FD`.

Reads a `RankStart`, joins the group, builds its slice of the model, reads its KV
cache's size, says `ready` (or why not), then runs each forward pass rank 0 sends,
until rank 0's end of the pipe closes.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import torch.distributed as dist

from engine.model.model_runner import ModelRunner, PackedTokens
from engine.parallel.ranks import HOST, RankStart, make_group, summing
from engine.parallel.shard import shard_model
from engine.parallel.shm_sum import SharedMemorySum
from engine.process import configure_process
from engine.quant.prepare import prepare_model


def build_runner(start: RankStart, from_rank0: Connection) -> ModelRunner:
    """This rank's runner: its slice of the model and a KV cache of its KV heads."""
    config = start.config
    configure_process(config)
    store = dist.TCPStore(HOST, start.store_port, config.tensor_parallel_size,
                          is_master=False)  # fmt: skip
    group = make_group(store, start.rank, config.tensor_parallel_size)
    parent = os.getppid()
    shm = SharedMemorySum(start.shm_name, config.tensor_parallel_size, start.rank,
                          start.max_sum_elements, lambda: os.getppid() == parent)  # fmt: skip
    model, _ = prepare_model(config)
    local = shard_model(model, config.tensor_parallel_size, start.rank, summing(group, shm))
    del model
    num_blocks = pickle.loads(from_rank0.recv_bytes())
    return ModelRunner(local, num_blocks, config)


def main(read_fd: int, write_fd: int) -> None:
    """Serve as one worker rank over the two pipe ends rank 0 passed down."""
    from_rank0 = Connection(read_fd, writable=False)
    to_rank0 = Connection(write_fd, readable=False)
    start: RankStart = pickle.loads(from_rank0.recv_bytes())
    try:
        runner = build_runner(start, from_rank0)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it
        to_rank0.send_bytes(pickle.dumps(traceback.format_exc()))
        raise
    to_rank0.send_bytes(pickle.dumps("ready"))
    while True:
        try:
            payload = from_rank0.recv_bytes()
        except EOFError:
            return
        tokens: PackedTokens = pickle.loads(payload)
        runner.forward_packed(tokens)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
