"""A frozen second model (a DPO reference, a teacher: every parameter requires_grad=False)
given to deepspeed.initialize with the training config, optimizer included, under ZeRO-3.
DeepSpeed builds the optimizer over no parameters and fails; without parameter offload with a
bare AssertionError, with it with `ValueError: max() arg is an empty sequence`. The fix, an
engine without an optimizer, gives the outputs of the same model in one process.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/frozen_model_engine.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys
import traceback
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, HIDDEN, SEED = 16, 8, 0


# --8<-- [start:config]
TRAINING_CONFIG = {  # the config the trained model's engine is built with
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
OFFLOADED = {**TRAINING_CONFIG, "zero_optimization": {
    **TRAINING_CONFIG["zero_optimization"], "offload_param": {"device": "cpu"}}}


def frozen_model(config):
    """The reference model: built under zero.Init, as from_pretrained builds it under
    ZeRO-3, and frozen."""
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB))
    return model.requires_grad_(False)
# --8<-- [end:config]


def tokens():
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB, (4, 6), generator=generator)


def error_of(call):
    """The error `call` raised, where, and the line that raised it: printed, not raised, so
    that one launch shows each case. The bare assert has no message of its own."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return {"error": f"{type(error).__name__}: {error}".rstrip(": "),
                "where": f"{frame.name} ({Path(frame.filename).name})", "line": frame.line}
    return None  # pragma: no cover (every case shown raises)


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    results = {}
    for name, config in (("training config", TRAINING_CONFIG),
                         ("training config, offload_param", OFFLOADED)):
        # --8<-- [start:fails]
        reference = frozen_model(config)
        # The training config's optimizer: DeepSpeed builds it over no trainable parameter.
        failed = error_of(lambda: deepspeed.initialize(model=reference, config=config))
        # --8<-- [end:fails]
        results[name] = failed
        say(f"{name}: {failed['error']}, raised in {failed['where']}")
        say(f"  {failed['line']}")

        # --8<-- [start:fix]
        reference = frozen_model(config)  # a new one: the failed call left hooks on the last
        no_optimizer = {key: value for key, value in config.items()
                        if key not in ("optimizer", "scheduler")}
        engine, *_ = deepspeed.initialize(model=reference, config=no_optimizer)
        engine.eval()
        with torch.no_grad():
            logits = engine(tokens().to(engine.device))
        # --8<-- [end:fix]
        results[f"{name}, no optimizer"] = logits.cpu()
        say(f"{name} without optimizer and scheduler: logits sum {logits.sum().item():.4f}")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
