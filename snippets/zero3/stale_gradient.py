"""The model of trace_cache.py on more schedules: under ZeRO-3 a parameter that gets no
gradient in a step is updated again with the gradient of the last step that gave it one,
with or without "Invalidate trace cache"; and a zero contribution (0.0 *) equals skipping a
module only with plain SGD. tests/zero3/test_stale_gradient.py compares it with plain
PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/stale_gradient.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import trace_cache  # the model, its training step and its output, from the same folder

# --8<-- [start:schedules]
SCHEDULES = {  # schedule: (what the auxiliary head does in a step, the optimizer)
    "step 1 only": (lambda step: "used" if step == 1 else "skipped", "SGD"),
    "odd steps, without its bias on the others":
        (lambda step: "used" if step % 2 else "no bias", "SGD"),
    "odd steps, always called, Adam": (lambda step: "used" if step % 2 else "zero", "Adam"),
}
# --8<-- [end:schedules]


def main():
    return trace_cache.main(SCHEDULES)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
