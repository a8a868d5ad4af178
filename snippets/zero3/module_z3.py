"""The ModuleZ3 example of the DeepSpeed docs, corrected, trained under ZeRO-3; it also shows
when DeepSpeed gathers and releases the registered weight.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/module_z3.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

DIM, BATCH, STEPS, SEED, LR = 8, 8, 3, 0, 0.1


# --8<-- [start:model]
class OtherLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, weight):
        # `weight` is just a tensor argument here; this forward cannot know whose it is.
        return self.proj(x) @ weight.t()


class ModuleZ3(nn.Module):
    def __init__(self):
        super().__init__()  # not super().__init__(self, ...)
        self.layer1 = nn.Linear(DIM, DIM)
        self.layer2 = OtherLayer()
        # layer1.weight belongs to layer1; ModuleZ3.forward reads it, so ModuleZ3 registers it.
        deepspeed.zero.register_external_parameter(self, self.layer1.weight)

    def forward(self, inputs):
        x = self.layer1(inputs)
        # self.layer1.weight is required by ModuleZ3.forward, which reads it here;
        # layer2.forward only receives a tensor.
        y = self.layer2(x, self.layer1.weight)
        return y
# --8<-- [end:model]


class ModuleZ3WithoutRegistration(ModuleZ3):
    """ModuleZ3 with the registration left out (same layers, created in the same order)."""

    def __init__(self):
        nn.Module.__init__(self)
        self.layer1 = nn.Linear(DIM, DIM)
        self.layer2 = OtherLayer()


def make_batch(step):
    """A regression batch: the same on every rank, for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)


def main(model_class=ModuleZ3):
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    # --8<-- [start:watch]
    weight = model.layer1.weight  # a plain reference, to look at the weight's state
    seen = []

    def watch(where):
        def hook(module, *args):
            seen.append((where, tuple(weight.shape), weight.ds_status.name))
        return hook

    # Added after deepspeed.initialize, so they run after DeepSpeed's own hooks.
    model.register_forward_pre_hook(watch("start of ModuleZ3.forward"))
    model.register_forward_hook(watch("end of ModuleZ3.forward"))
    # --8<-- [end:watch]

    losses, grads, watched = [], [], []
    for step in range(STEPS):
        mine = slice(rank, None, world)  # each rank trains on its share of the batch
        inputs, targets = (t[mine].to(engine.device) for t in make_batch(step))
        loss = F.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        seen.append(("after engine.backward", tuple(weight.shape), weight.ds_status.name))
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).cpu()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
            for where, shape, status in seen:
                print(f"  {where:26} layer1.weight {str(shape):7} {status}")
        watched.append(seen[:])
        seen.clear()
    torch.distributed.destroy_process_group()
    return {"losses": losses, "grads": grads, "watched": watched, "ds_shape": tuple(weight.ds_shape)}


def main_without_registration():
    """The same run without the registration: DeepSpeed detects this read by itself."""
    return main(ModuleZ3WithoutRegistration)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
