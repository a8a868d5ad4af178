"""The model of prefetch_trace.py, trained without the error: the head's weight read on every
step (with a zero contribution where a step does not want it), or registered in __init__
(no error, but the steps that skip the read are updated with the previous step's gradient);
and generation between training steps. tests/zero3/test_prefetch_trace_fixes.py compares
each with plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/prefetch_trace_fixes.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import prefetch_trace  # the model, its training step and generation, from the same folder

# --8<-- [start:schedules]
SCHEDULES = {  # (training step N, the generation after it, register in __init__)
    "odd steps, 0.0 * on the others":
        (lambda step: "read" if step % 2 else "zero", None, False),
    "odd steps, registered in __init__":
        (lambda step: "read" if step % 2 else "skipped", None, True),
    "no step, generation between steps":
        (lambda step: "skipped", "skipped", False),
    "generation only, 0.0 * in training":
        (lambda step: "zero", "read", False),
}
# --8<-- [end:schedules]


def main():
    return prefetch_trace.main(SCHEDULES)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
