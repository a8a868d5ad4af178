"""A tied model saved and loaded with torch.distributed.checkpoint (dcp.save, dcp.load) and
the state-dict helpers (get_state_dict, set_state_dict), under FSDP2 and FSDP1: which keys
are written, whether the reloaded model is still tied, and whether it resumes exactly.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_tied_dcp.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS = 16, 8, 6, 8, 0, 0.05, 2


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens):
        return self.head(torch.tanh(self.mixer(self.embed(tokens))))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def wrap(layout, device):
    """The model and what takes part in training: the wrapper for FSDP1."""
    torch.manual_seed(SEED)
    model = TiedLanguageModel().to(device)
    if layout == "FSDP2":
        fully_shard(model)
        return model, model
    if layout == "FSDP1":
        return model, FSDP(model, device_id=device)
    if layout == "FSDP1, use_orig_params=True":
        return model, FSDP(model, device_id=device, use_orig_params=True)
    raise ValueError(layout)  # pragma: no cover (a layout this file does not define)


LAYOUTS = ["FSDP2", "FSDP1", "FSDP1, use_orig_params=True"]


def train(wrapped, optimizer, steps, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked there)")
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses = []
    for _ in range(steps):
        logits = wrapped(tokens[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
    return losses


# --8<-- [start:save_load]
def save(wrapped, optimizer, folder, options):
    model_state, optim_state = get_state_dict(wrapped, optimizer, options=options)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)


def load(wrapped, optimizer, folder, options):
    model_state, optim_state = get_state_dict(wrapped, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)  # fills the tensors in `state`
    set_state_dict(wrapped, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)


def save_train_reload(layout, folder, options, device):
    model, wrapped = wrap(layout, device)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=LR)
    before = train(wrapped, optimizer, STEPS, device)
    save(wrapped, optimizer, folder, options)
    uninterrupted = train(wrapped, optimizer, STEPS, device)  # resuming must give it
    fresh, wrapped = wrap(layout, device)  # a new process would start here
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=LR)
    load(wrapped, optimizer, folder, options)
    tied = fresh.head.weight is fresh.embed.weight
    return before, uninterrupted, train(wrapped, optimizer, STEPS, device), tied
# --8<-- [end:save_load]


def written(folder):
    """The keys dcp.save wrote: the model's, and the tensors of Adam's state."""
    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    model = sorted(k.removeprefix("model.") for k in keys if k.startswith("model."))
    state = sorted(k.removeprefix("optim.state.").removesuffix(".exp_avg")
                   for k in keys
                   if k.startswith("optim.state.") and k.endswith(".exp_avg"))
    return model, state


def full_state_keys(layout, device):
    """The keys of the full state dict (full_state_dict=True)."""
    _, wrapped = wrap(layout, device)
    options = StateDictOptions(full_state_dict=True)
    return list(get_model_state_dict(wrapped, options=options))


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one folder, rank 0's
    cases = [(layout, False) for layout in LAYOUTS] + [("FSDP2", True)]
    results = {}
    for layout, flat in cases:
        name = layout + (", flatten_optimizer_state_dict=True" if flat else "")
        folder = os.path.join(root[0], str(len(results)))
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        before, uninterrupted, resumed, tied = save_train_reload(
            layout, folder, options, device)
        results[name] = {"before": before, "uninterrupted": uninterrupted,
                         "resumed": resumed, "tied": tied, "written": written(folder)}
    full = {layout: full_state_keys(layout, device) for layout in LAYOUTS}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0])
        for name, got in results.items():
            model_keys, adam_keys = got["written"]
            print(f"{name}:")
            print(f"  written: model {model_keys}; Adam state of {adam_keys}")
            print(f"  reloaded: head is embed {got['tied']}")
            print("  steps 3-4 uninterrupted "
                  f"{[round(x, 4) for x in got['uninterrupted']]}, resumed "
                  f"{[round(x, 4) for x in got['resumed']]}")
        for layout, keys in full.items():
            print(f"{layout} full_state_dict=True: {keys}")
    dist.destroy_process_group()
    return {"results": results, "full": full}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
