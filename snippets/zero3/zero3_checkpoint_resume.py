"""Resume on 4 ranks the tied model that zero3_checkpoint.py saved on 2 ranks: load_checkpoint
as it is, DeepSpeed's universal checkpoint converter (ds_to_universal), and the consolidated
fp32 weights loaded before deepspeed.initialize.

Run zero3_checkpoint.py on 2 ranks first, then this on CPU (4 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/zero3_checkpoint.py
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/zero3/zero3_checkpoint_resume.py
Run and tested here on CPU only.
"""
import contextlib
import io
import os
import subprocess
import sys
import traceback

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from zero3_checkpoint import (CHECKPOINTS, LR, SAVED_AFTER, STEPS, TiedModel, ds_config,
                              new_engine, train_step)

SAVED = os.path.join(CHECKPOINTS, "2-ranks", "tied")  # written by zero3_checkpoint.py on 2 ranks


def error_text(call):
    """The error `call` raised, with the DeepSpeed function that raised it."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        where = traceback.extract_tb(error.__traceback__)[-1]
        raised_in = f"{os.path.basename(where.filename)}, {where.name}"
        return f"{type(error).__name__}: {' '.join(str(error).split())} ({raised_in})"
    return None  # pragma: no cover (every case shown raises)


def resume(engine):
    return [train_step(engine, step) for step in range(SAVED_AFTER, STEPS)]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if not os.path.isdir(SAVED):
        # Not run in the suite: it makes the 2-rank save first.
        raise FileNotFoundError(  # pragma: no cover
            f"{SAVED}: run zero3_checkpoint.py on 2 ranks first")
    results = {}

    # --8<-- [start:as_is]
    engine = new_engine(TiedModel, ds_config(world))
    results["as is"] = error_text(lambda: engine.load_checkpoint(SAVED))
    # --8<-- [end:as_is]
    results["as is errors"] = [None] * world
    torch.distributed.all_gather_object(results["as is errors"], results["as is"])

    # --8<-- [start:universal]
    if rank == 0:  # one process converts the 2-rank files into per-parameter files
        converter = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        done = subprocess.run([*converter,
                               "--input_folder", os.path.join(SAVED, "global_step2"),
                               "--output_folder", os.path.join(SAVED, "universal")],
                              capture_output=True, text=True)
        results["universal"] = done.returncode, done.stderr.strip().splitlines()[-1]
    # --8<-- [end:universal]

    # --8<-- [start:weights]
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its progress
        state_dict = get_fp32_state_dict_from_zero_checkpoint(SAVED)
    model = TiedModel()
    model.load_state_dict(state_dict)  # before initialize: ZeRO-3 partitions it there
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # plain SGD keeps no state
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(world))
    results["weights only"] = resume(engine)
    # --8<-- [end:weights]

    if rank == 0:
        print(f"load_checkpoint of the 2-rank checkpoint on {world} ranks, by rank:")
        for other, error in enumerate(results["as is errors"]):
            print(f"  rank {other}: {error or 'loaded'}")
        code, last_line = results["universal"]
        print(f"ds_to_universal: exit {code}, last line: {last_line}")
        print("resumed (weights only): losses "
              + ", ".join(f"{x:.4f}" for x in results["weights only"]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
