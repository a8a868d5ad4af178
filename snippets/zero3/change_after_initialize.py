"""A change to a ZeRO-3 weight made after deepspeed.initialize: GatheredParameters(modifier_rank=0)
is undone by the next engine.step(); deepspeed.utils.safe_set_full_fp32_param changes the copy the
optimizer keeps. Run with SGD and with torch's Adam, both with lr=0.0.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/change_after_initialize.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

DIM, BATCH, SEED = 4, 2, 0
OPTIMIZERS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}


def full_weight(weight):
    """The full weight as the model holds it, the same on every rank (a collective)."""
    with deepspeed.zero.GatheredParameters(weight):
        return weight.detach().clone()


def values(tensor):
    return [round(v, 4) for v in tensor.unique().tolist()]


def get_state(weight, name):
    """Adam's exp_avg for the full weight (a collective); SGD without momentum keeps no state."""
    if name == "Adam":
        return deepspeed.utils.safe_get_full_optimizer_state(weight, "exp_avg").clone()
    return None


def train_step(engine, inputs):
    loss = engine(inputs).square().mean()
    engine.backward(loss)
    engine.step()
    return round(loss.item(), 4)


def run(name, rank):
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, 1))
    # --8<-- [start:before]
    # Before deepspeed.initialize: the optimizer's copy is made from this, so the change stays.
    with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):
        with torch.no_grad():
            model[0].weight.fill_(0.5)
    # --8<-- [end:before]
    optimizer = OPTIMIZERS[name](model.parameters(), lr=0.0)  # lr=0.0: a step changes nothing
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    weight = engine.module[0].weight
    inputs = torch.ones(BATCH, DIM).to(engine.device)
    seen = {"loss at 0.5": train_step(engine, inputs), "before initialize": values(full_weight(weight))}

    # --8<-- [start:undone]
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            weight.fill_(1.0)
    after_block = full_weight(weight)
    loss = train_step(engine, inputs)  # this step's forward and backward see 1.0...
    after_step = full_weight(weight)  # ...and the step writes the optimizer's copy back: 0.5
    # --8<-- [end:undone]
    seen["undone"] = (values(after_block), loss, values(after_step))

    # --8<-- [start:fp32]
    deepspeed.utils.safe_set_full_fp32_param(weight, torch.full((DIM, DIM), 2.0))
    before_step = full_weight(weight)  # the model's copy is still 0.5...
    loss = train_step(engine, inputs)  # ...so this step computes with 0.5
    after_step = full_weight(weight)  # 2.0 from this step on
    # --8<-- [end:fp32]
    seen["fp32"] = (values(before_step), loss, values(after_step))

    # --8<-- [start:both]
    new = torch.full((DIM, DIM), 3.0)
    state_before = get_state(weight, name)
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            weight.copy_(new)  # the model's copy: the next forward computes with it
    deepspeed.utils.safe_set_full_fp32_param(weight, new)  # the optimizer's copy: the step keeps it
    # --8<-- [end:both]
    state_after = get_state(weight, name)
    before_step = full_weight(weight)
    loss = train_step(engine, inputs)
    seen["both"] = (values(before_step), loss, values(full_weight(weight)),
                    values(deepspeed.utils.safe_get_full_fp32_param(weight)))

    if rank == 0:
        print(f"{name}, lr=0.0: filled with 0.5 before initialize: {seen['before initialize']} after a step (loss {seen['loss at 0.5']})")
        print(f"{name}: GatheredParameters(modifier_rank=0) to 1.0 after initialize: {seen['undone'][0]} after the block, "
              f"step loss {seen['undone'][1]}, {seen['undone'][2]} after engine.step()")
        print(f"{name}: safe_set_full_fp32_param to 2.0: {seen['fp32'][0]} before engine.step(), "
              f"step loss {seen['fp32'][1]}, {seen['fp32'][2]} after")
        print(f"{name}: both to 3.0: {seen['both'][0]} before engine.step(), step loss {seen['both'][1]}, "
              f"{seen['both'][2]} after (optimizer's copy {seen['both'][3]})")
    if name == "Adam":
        # --8<-- [start:state]
        for key in ("exp_avg", "exp_avg_sq"):  # start Adam's statistics afresh for this weight
            deepspeed.utils.safe_set_full_optimizer_state(weight, torch.zeros(DIM, DIM), key)
        # --8<-- [end:state]
        reset = [values(deepspeed.utils.safe_get_full_optimizer_state(weight, key)) for key in ("exp_avg", "exp_avg_sq")]
        seen["state"] = (state_before, state_after, reset)
        if rank == 0:
            print(f"Adam: exp_avg the same before and after the change to 3.0: {torch.equal(state_before, state_after)} "
                  f"(sum {state_after.sum().item():.4f}); after safe_set_full_optimizer_state: "
                  f"exp_avg {reset[0]}, exp_avg_sq {reset[1]}")
    return seen


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    seen = {name: run(name, rank) for name in OPTIMIZERS}
    torch.distributed.destroy_process_group()
    return seen


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
