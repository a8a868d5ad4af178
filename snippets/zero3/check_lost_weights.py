"""check_shared_reads.py on weights ZeRO-3 loses: torch's nn.TransformerEncoder, whose
layers are copies of a partitioned layer (copied_layers.py), and nn.Embedding(max_norm=...),
whose forward writes into the gathered weight (lost_writes.py); each as written and with
the checker's fixes. Each function below is a factory the checker's command takes:
    python snippets/zero3/check_shared_reads.py snippets/zero3/check_lost_weights.py:encoder
Run them all (one process, CPU):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/zero3/check_lost_weights.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checker and the pages' models
from check_shared_reads import check_shared_reads, print_table  # noqa: E402
from copied_layers import Encoder, make_batch  # noqa: E402
from copied_layers_fixed import FixedEncoder  # noqa: E402
from lost_writes import Tagger, loss_of, renorm_rows  # noqa: E402


# --8<-- [start:factories]
def encoder():
    """copied_layers.py's Encoder, as written."""
    tokens, targets = make_batch(0)
    return Encoder, (tokens,)


def encoder_fixed():
    """The same with the checker's two fixes (copied_layers_fixed.py)."""
    tokens, targets = make_batch(0)
    return FixedEncoder, (tokens,)


def tagger():
    """lost_writes.py's Tagger: nn.Embedding(max_norm=...) writes in its forward."""
    return Tagger, make_batch(0), lambda engine, batch: loss_of(engine, *batch)


def tagger_fixed():
    """Tagger(max_norm=None), renormalised in the loop on both copies (lost_writes.py)."""
    def loop(engine, batch):
        renorm_rows(engine, batch[0])
        return loss_of(engine, *batch)

    return lambda: Tagger(max_norm=None), make_batch(0), loop
# --8<-- [end:factories]


FACTORIES = [encoder, encoder_fixed, tagger, tagger_fixed]


def main():
    found = {}
    for factory in FACTORIES:
        print(f"$ check_shared_reads.py check_lost_weights.py:{factory.__name__}")
        torch.manual_seed(0)
        found[factory.__name__] = check_shared_reads(*factory())
        print_table(found[factory.__name__])
        print()
    return {name: [vars(f) for f in findings] for name, findings in found.items()}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
