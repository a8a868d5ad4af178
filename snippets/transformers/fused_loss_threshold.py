"""The fused loss of fused_loss.py under other values of stage3_param_persistence_threshold
than the page's 0: DeepSpeed's default (1e5 elements), under which every weight of this tiny
model is small enough to persist, and 1e10, the value the reader of Liger-Kernel issue #1048
set. The placements that fail on the page, and the one that trains with what each rank holds
after the steps.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/fused_loss_threshold.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

from fused_loss import BATCH, GradientInForward, train

FAILING = ["weight passed from the training loop",
           "gathered in the loop, backward after the block",
           "run as the engine's forward, after a call of the whole model"]
TRAINS = "weight read in the model's forward"


# --8<-- [start:config]
def ds_config(threshold, world):
    """threshold None: the key left out, DeepSpeed's default."""
    zero = {"stage": 3}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    return {"train_micro_batch_size_per_gpu": BATCH // world,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0}
# --8<-- [end:config]


THRESHOLDS = {"threshold 0": 0, "DeepSpeed's default threshold": None,
              "threshold 1e10": 1e10}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} sequences do not split evenly over {world} ranks; run "
                         "on 2 ranks (the printed losses were checked there)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    results = {}
    for label, threshold in THRESHOLDS.items():
        say(f"{label}:")
        for placement in FAILING + [TRAINS]:
            config = ds_config(threshold, world)
            zero3 = HfDeepSpeedConfig(config)  # as fused_loss.py: TRL's helper gathers
            results[label, placement] = got = train(placement, GradientInForward, config)
            del zero3
            losses = " ".join(f"{x:.4f}" for x in got["losses"]) or "-"
            held = (f"; after the steps this rank holds {got['held']} of the model's "
                    f"{got['elements']} elements whole" if not got["error"] else "")
            say(f"  {placement}: losses {losses}"
                + (f", then {got['error']}" if got["error"] else held))
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
