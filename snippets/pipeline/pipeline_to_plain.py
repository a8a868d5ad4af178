"""The tied pipeline model of deepspeed_tied_checkpoint.py, saved on 2 stages, turned into one
plain state dict (the tied weight once: the head reads the embedding) and loaded into a
one-process model; then DeepSpeed's universal checkpoint converter on the same files.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/pipeline_to_plain.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import subprocess
import sys
import tempfile

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from deepspeed_tied_checkpoint import (DIM, VOCAB, Mixer, cross_entropy, micro_batches,
                                       new_engine, train)

SAVED_AFTER = 2


# --8<-- [start:plain]
class PlainModel(nn.Module):
    """The pipeline's layers in one process: the head reads the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.mixers = nn.Sequential(Mixer(), Mixer())

    def forward(self, tokens):
        return self.mixers(self.embedding(tokens)) @ self.embedding.weight.t()


def plain_state_dict(folder):
    """One state dict from the per-layer files: layer 0 holds the tied weight,
    layer 3 (the head) has no file, layers 1 and 2 are the mixers."""
    def layer(index):
        path = os.path.join(folder, f"layer_{index:02d}-model_states.pt")
        return torch.load(path, map_location="cpu", weights_only=True)

    state_dict = {"embedding.weight": layer(0)["weight"]}
    for index in (1, 2):
        state_dict.update({f"mixers.{index - 1}.{key}": value
                           for key, value in layer(index).items()})
    return state_dict
# --8<-- [end:plain]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    shared = [tempfile.mkdtemp(prefix="pipeline-checkpoint-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)  # one directory for every rank
    directory = shared[0]

    engine = new_engine()
    losses = train(engine, range(SAVED_AFTER))
    engine.save_checkpoint(directory, tag="step2")
    # The pipeline's loss on the next step's micro-batches, without training on them.
    evaluated = engine.eval_batch(data_iter=micro_batches(SAVED_AFTER)).item()
    torch.distributed.barrier()
    result = {"losses": losses, "evaluated": evaluated}
    if rank == 0:
        folder = os.path.join(directory, "step2")
        # --8<-- [start:load]
        model = PlainModel()
        model.load_state_dict(plain_state_dict(folder))  # strict: every key, once
        with torch.no_grad():
            batches = list(micro_batches(SAVED_AFTER))
            each = [cross_entropy(model(x), y).item() for x, y in batches]
            plain = sum(each) / len(each)
        # --8<-- [end:load]
        # --8<-- [start:universal]
        converter = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        done = subprocess.run([*converter, "--input_folder", folder,
                               "--output_folder", os.path.join(directory, "universal")],
                              capture_output=True, text=True)
        # --8<-- [end:universal]
        last_line = done.stderr.strip().splitlines()[-1].replace(folder, "<folder>")
        print(f"keys: {sorted(plain_state_dict(folder))}")
        print(f"next step's loss: pipeline {evaluated:.4f}, one process {plain:.4f}")
        print(f"ds_to_universal: exit {done.returncode}, last line: {last_line}")
        result.update(state_dict=plain_state_dict(folder), plain=plain,
                      universal=(done.returncode, last_line))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
