"""A custom weight initialization in a constructor that runs under deepspeed.zero.Init:
through `self.apply(...)`, through a loop over `self.modules()`, and with a direct
`.data.mul_`. Each model's full weights are printed beside the same model built in one
process without DeepSpeed.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/init_in_constructor.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEED = 16, 8, 0

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    # Partition even these tiny weights, as large ones are.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


# --8<-- [start:model]
class LanguageModel(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        # Under zero.Init both submodules are already partitioned here.
        if init == "self.apply(self._init_weights)":
            self.apply(self._init_weights)  # the Hugging Face pattern
        elif init == "for m in self.modules(): ...":
            for module in self.modules():  # the same function, without apply
                self._init_weights(module)
        elif init == "self.mixer.weight.data.mul_(0.5)":
            self.mixer.weight.data.mul_(0.5)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear):
            module.bias.data.zero_()
# --8<-- [end:model]


INITS = ["self.apply(self._init_weights)", "for m in self.modules(): ...",
         "self.mixer.weight.data.mul_(0.5)"]


def full_weights(model):
    """Every parameter's full tensor (gathered under ZeRO-3; as it is without it)."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):  # read only; no-op without ZeRO-3
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def build(init, zero3):
    torch.manual_seed(SEED)
    if not zero3:
        return full_weights(LanguageModel(init))
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        model = LanguageModel(init)
    return full_weights(model)


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {init: {"zero3": build(init, True), "one process": build(init, False)}
               for init in INITS}
    if torch.distributed.get_rank() == 0:
        for init, got in results.items():
            zero3, plain = got["zero3"], got["one process"]
            same = all(torch.equal(zero3[name], plain[name]) for name in plain)
            print(f"{init}\n  mixer.weight std {zero3['mixer.weight'].std():.4f} "
                  f"(one process: {plain['mixer.weight'].std():.4f}), "
                  f"every weight as in one process: {same}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
