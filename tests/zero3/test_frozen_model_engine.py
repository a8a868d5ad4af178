"""snippets/zero3/frozen_model_engine.py on 2 and 4 ranks: a frozen model given to
deepspeed.initialize with the training config's optimizer fails on every rank, with the bare
AssertionError of DeepSpeed's defragment (the assert line is the message a reader sees) or,
with parameter offload, with `ValueError: max() arg is an empty sequence`; without optimizer and
scheduler its logits equal the same model's in one process."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/frozen_model_engine.py"
EXAMPLE = example_namespace(SNIPPET)
FAILURES = {
    "training config": {
        "error": "AssertionError", "where": "defragment (utils.py)",
        "line": "assert len(set(t.dtype for t in tensors)) == 1"},
    "training config, offload_param": {
        "error": "ValueError: max() arg is an empty sequence",
        "where": "initialize_optimizer_states (stage3.py)",
        "line": "largest_numel = max([sum([p.ds_numel for p in psg]) "
                "for psg in self.fp16_partitioned_groups])"},
}


def logits_in_one_process():
    torch.manual_seed(EXAMPLE["SEED"])
    model = torch.nn.Sequential(torch.nn.Embedding(EXAMPLE["VOCAB"], EXAMPLE["HIDDEN"]),
                                torch.nn.Linear(EXAMPLE["HIDDEN"], EXAMPLE["VOCAB"]))
    with torch.no_grad():
        return model(EXAMPLE["tokens"]())


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_model_needs_an_engine_without_optimizer(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    want = logits_in_one_process()
    for rank in range(world_size):
        got = result.returned(rank)
        for name, failure in FAILURES.items():
            assert got[name] == failure, (rank, name, got[name])
            assert_matches(got[f"{name}, no optimizer"], want, f"rank {rank} {name} logits")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
