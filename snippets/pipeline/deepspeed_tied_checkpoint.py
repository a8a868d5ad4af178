"""Checkpoints of the tied language model on 2 DeepSpeed pipeline stages: what the checkpoint
holds for the tie, loading it into a fresh engine with the same split and with another split,
and what the stage-1 copy costs.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/deepspeed_tied_checkpoint.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import shutil
import sys
import tempfile

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 1234, 0.05
MICRO_BATCH, MICRO_BATCHES, STEPS, SAVED_AFTER = 4, 2, 4, 2


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


def logits_from_embedding(embedding, hidden):
    return hidden @ embedding.weight.t()


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def micro_batches(step):
    """Step `step`'s micro-batches: another batch every step, so a resume at the wrong step shows."""
    generator = torch.Generator().manual_seed(step)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:engine]
def new_engine(partition_method="uniform"):
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
              LayerSpec(Mixer), LayerSpec(Mixer),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM,
                            forward_fn=logits_from_embedding)]
    # "uniform": layers 0-1 on stage 0, 2-3 on stage 1. "type:Embedding": layers 0-2, then 3.
    model = PipelineModule(layers, num_stages=2, loss_fn=cross_entropy,
                           partition_method=partition_method,
                           seed_layers=partition_method == "uniform", base_seed=SEED)
    # Adam: state to save, two moments per weight.
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                 "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def train(engine, steps):
    return [engine.train_batch(data_iter=micro_batches(step)).item() for step in steps]
# --8<-- [end:engine]


def copies_equal(engine):
    weight = engine.module.tied_modules["embed"].weight.detach().contiguous()
    copies = [torch.empty_like(weight) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(copies, weight)
    return all(torch.equal(copy, copies[0]) for copy in copies)


def checkpoint_contents(directory):
    """File name -> the names of what it holds (the model's weights, or optimizer state)."""
    contents = {}
    for name in sorted(os.listdir(directory)):
        saved = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=False)
        if name.startswith("layer_"):
            contents[name] = sorted(saved)
        else:  # mp_rank_XX_model_states.pt: one per stage
            contents[name] = f"optimizer state of {len(saved['optimizer']['state'])} tensors"
    return contents


def stage_bytes(engine):
    """Bytes this stage holds for its parameters, and for the tied copy alone (weight, Adam state)."""
    tied = engine.module.tied_modules["embed"].weight
    state = engine.optimizer.state[tied]
    return {"parameters": sum(p.nbytes for p in engine.module.parameters()),
            "tied weight": tied.nbytes,
            "tied Adam state": state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world != 2:  # what rank r holds is printed as stage r's
        raise ValueError(f"the stages are printed by rank: one rank per stage, not "
                         f"{world} ranks; run on 2 ranks (the printed output was "
                         "checked there)")
    shared = [tempfile.mkdtemp(prefix="tied-checkpoint-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)  # one directory for every rank
    directory = shared[0]

    uninterrupted = train(new_engine(), range(STEPS))

    # --8<-- [start:save]
    engine = new_engine()
    before = train(engine, range(SAVED_AFTER))
    engine.save_checkpoint(directory, tag="step2")
    # --8<-- [end:save]
    state_dict_keys = sorted(engine.module.state_dict())
    bytes_held = stage_bytes(engine)
    torch.distributed.barrier()
    contents = checkpoint_contents(os.path.join(directory, "step2"))

    # --8<-- [start:resume]
    same_split = new_engine()
    same_split.load_checkpoint(directory, tag="step2")
    resumed = before + train(same_split, range(SAVED_AFTER, STEPS))

    other_split = new_engine("type:Embedding")
    try:
        other_split.load_checkpoint(directory, tag="step2")
    except ValueError as error:  # the optimizer state was saved per stage, for the old split
        refused = f"{type(error).__name__}: {error}"
    other_split.load_checkpoint(directory, tag="step2", load_optimizer_states=False)
    resplit = before + train(other_split, range(SAVED_AFTER, STEPS))
    # --8<-- [end:resume]

    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (state_dict_keys, bytes_held))
    equal = {"same split": copies_equal(same_split), "other split": copies_equal(other_split)}
    if rank == 0:
        print("files in the checkpoint (tag step2):")
        for name, held in contents.items():
            print(f"  {name}: {held}")
        for stage, (keys, held) in enumerate(everyone):
            print(f"stage {stage} state_dict: {keys}")
            print(f"stage {stage} holds {held['parameters']} bytes of parameters; the tied copy: "
                  f"{held['tied weight']} bytes of weight, {held['tied Adam state']} of Adam state")
        print(f"loading with another split: {refused}")
        for label, losses in [("uninterrupted", uninterrupted), ("resumed, same split", resumed),
                              ("resumed, other split, no optimizer state", resplit)]:
            print(f"{label}: losses " + ", ".join(f"{loss:.4f}" for loss in losses))
        print(f"copies equal after loading: {equal}")
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(directory)
    torch.distributed.destroy_process_group()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "resplit": resplit, "refused": refused,
            "contents": contents, "stages": everyone, "copies_equal": equal,
            "parts": [same_split.module.parts, [int(p) for p in other_split.module.parts]],
            "weight": same_split.module.tied_modules["embed"].weight.detach().clone()}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
