"""Record when ZeRO-3 gathers and releases each parameter of the LanguageModel example.

Run on CPU (2 processes), optionally writing every event to a JSON file:
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/notebooks/gather_timeline.py [events.json]
Run and tested here on CPU only; not run on GPUs. The backend and the device come from
deepspeed.accelerator.get_accelerator().

It trains the LanguageModel of snippets/zero3/language_model.py (loaded from that file, not
copied) for two steps, twice: as the page shows it (LanguageModel registers
embeddings.weight), and with that registration undone.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

EXAMPLE = Path(__file__).resolve().parents[1] / "zero3" / "language_model.py"
STEPS = 2
ZERO = {"stage": 3, "stage3_param_persistence_threshold": 0}


# --8<-- [start:record]
def snapshot(model):
    """What this rank holds of every parameter right now: the full shape, or (0,)."""
    return {name: {"shape": list(p.data.shape), "status": p.ds_status.name}
            for name, p in model.named_parameters()}


def attach_recorder(model, record):
    """Module hooks that log the parameters' state around every module's forward and backward.

    They are added after deepspeed.initialize, so in forward they run after DeepSpeed's own
    hooks: at "start" DeepSpeed has gathered what the module needs, at "end" it has released
    what it frees. In backward the hook runs when the gradient of the module's output is
    ready, before DeepSpeed gathers for that module's backward.
    """
    for name, module in model.named_modules():
        label = name or type(model).__name__
        module.register_forward_pre_hook(
            lambda m, a, label=label: record(label, "forward", "start"))
        module.register_forward_hook(
            lambda m, a, o, label=label: record(label, "forward", "end"))
        module.register_full_backward_pre_hook(
            lambda m, g, label=label: record(label, "backward", "start"))
# --8<-- [end:record]


def train(example, register, rank, world):
    ds_config = {
        "train_micro_batch_size_per_gpu": example["BATCH"] // world,
        "zero_optimization": dict(ZERO),
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(example["SEED"])
    # --8<-- [start:variant]
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = example["LanguageModel"]()  # registers embeddings.weight in __init__
    if not register:
        unregister_external_parameter(model, model.embeddings.weight)
    # --8<-- [end:variant]
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    events, losses, external = [], [], []
    names = {id(p): name for name, p in engine.module.named_parameters()}

    def record(module_name, phase, moment):
        events.append({"step": step, "module": module_name, "phase": phase,
                       "moment": moment, "params": snapshot(engine.module)})

    attach_recorder(engine.module, record)
    for step in range(STEPS):
        inputs, targets = example["make_batch"](step)
        mine = slice(rank, None, world)
        logits = engine(inputs[mine].to(engine.device))
        loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]),
                               targets[mine].reshape(-1).to(engine.device))
        engine.backward(loss)
        record("engine", "backward", "end")
        engine.step()
        losses.append(round(loss.item(), 4))
        # The parameters LanguageModel's forward gathers besides its own, after this step.
        external.append([names[key] for key, _ in engine.module.ds_external_parameters()])
    return events, losses, external


def show(events):
    """One line per hook call: which parameters this rank holds in full at that moment."""
    for e in events:
        full = [name for name, p in e["params"].items() if p["shape"] != [0]]
        print(f"  step {e['step']} {e['phase']:8} {e['moment']:5} {e['module']:13} "
              f"full: {', '.join(full) or '-'}")


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world != 2:  # rank 0 prints the losses of its own share of the batch
        raise ValueError(f"rank 0's losses differ on {world} ranks (they are those "
                         "of its share of the batch); run on 2 ranks (the printed "
                         "output was checked there)")
    example = runpy.run_path(str(EXAMPLE))  # the page's LanguageModel, not a copy
    # For the notebook: how far ahead, in parameter elements, DeepSpeed looks before it
    # releases a weight (stage3_max_reuse_distance, as ZERO leaves it), and the model's size.
    result = {"max_reuse_distance": DeepSpeedZeroConfig(**ZERO).max_reuse_distance,
              "model_numel": sum(p.numel() for p in example["LanguageModel"]().parameters()),
              "variants": {}}
    for register in (True, False):
        variant = "registered" if register else "not registered"
        events, losses, external = train(example, register, rank, world)
        result["variants"][variant] = {"events": events, "losses": losses, "external": external}
        if rank == 0:
            print(f"embeddings.weight {variant}: losses on rank 0 {losses}")
            show(events)
            for step, names in enumerate(external):
                print(f"  after step {step}, external parameters of LanguageModel: {names}")
    if rank == 0:  # the notebook passes a file name; without one the events go nowhere
        Path(sys.argv[1] if len(sys.argv) > 1 else os.devnull).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
