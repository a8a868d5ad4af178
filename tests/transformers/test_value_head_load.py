"""snippets/transformers/value_head_load.py: a value head's trained weights loaded into a model
ZeRO-3 partitions. load_state_dict into the partitioned head raises the exact size mismatch
against torch.Size([0]) (built here from the head's shapes), before and after
deepspeed.initialize; after a training step under DeepSpeed's default persistence threshold the
head is whole and the load raises nothing, but the next engine.step() writes back the
optimizer's copy, which never saw the load. The fixes load the file's head and train exactly as
one process without DeepSpeed; generate() through the wrapper gives one process's tokens."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/transformers/value_head_load.py"
TIMEOUT = 600
FIXES = ["load, then initialize", "GatheredParameters(modifier_rank=0)"]
REFUSED = ["reader", "after initialize, threshold 0", "after initialize, DeepSpeed's default",
           "after a step, threshold 0"]
SILENT = "after a step, DeepSpeed's default"


def mismatch(hidden):
    return ("RuntimeError: Error(s) in loading state_dict for ValueHead: size mismatch for "
            f"summary.weight: copying a param with shape torch.Size([1, {hidden}]) from "
            "checkpoint, the shape in current model is torch.Size([0]). size mismatch for "
            "summary.bias: copying a param with shape torch.Size([1]) from checkpoint, the "
            "shape in current model is torch.Size([0]).")


@pytest.fixture(scope="module")
def reference():
    """The wrapper in one process without DeepSpeed: trained from the file's head with plain SGD
    on each step's whole batch (the ranks' micro-batches together)."""
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])
    directory = ex["save_tiny_llama"]()
    hidden = LlamaForCausalLM.from_pretrained(directory).config.hidden_size
    head = torch.load(ex["save_value_head"](hidden))

    def whole_batch(step):
        generator = torch.Generator().manual_seed(ex["SEED"] + step)
        return torch.randint(0, ex["VOCAB"], (2 * ex["BATCH"], ex["SEQ"]), generator=generator)

    def train(model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
        heads = [{k: v.detach().clone() for k, v in model.v_head.state_dict().items()}]
        for step in steps:
            ex["loss_of"](model, whole_batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            heads.append({k: v.detach().clone() for k, v in model.v_head.state_dict().items()})
        return heads

    model = ex["CausalLMWithValueHead"](LlamaForCausalLM.from_pretrained(directory))
    model.v_head.load_state_dict(head)
    heads = train(model, range(ex["STEPS"]))
    with torch.no_grad():
        tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    # The checkpoint case: the trained engine's checkpoint, trained STEPS steps more.
    resumed = train(model, range(ex["STEPS"]))
    return {"ex": ex, "hidden": hidden, "head": head, "heads": heads, "resumed": resumed,
            "tokens": tokens}


@pytest.mark.parametrize("world_size", [2, 4])
def test_loads_and_fixes(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        label = f"rank {rank}"
        for name in REFUSED:
            assert got[name]["error"] == mismatch(reference["hidden"]), (label, name)
        # Each fix trains as one process trains from the file's head.
        for name in FIXES:
            assert_matches(got[name]["heads"], reference["heads"], f"{label}, {name}")
        # The checkpoint holds the trained head, and training on from it is the same.
        assert_matches(got["engine.load_checkpoint"]["heads"], reference["resumed"],
                       f"{label}, load_checkpoint")
        assert torch.equal(got["from_pretrained"]["score"], reference["head"]["summary.weight"])
        assert torch.equal(got["generate"], reference["tokens"]), label
        # Loaded after a step under the default threshold: the head is whole (persistent), the
        # load raises nothing and the next forward and backward use it, but the optimizer's
        # copy never saw it: engine.step() updates that copy and writes it back, so the loaded
        # values are gone after one step.
        silent, lr = got[SILENT], reference["ex"]["LR"]
        assert silent["error"] is None
        assert all(torch.equal(silent["loaded"][k], v) for k, v in reference["head"].items())
        assert not matches(silent["optimizer's copy"], reference["head"])
        step_from = {k: silent["optimizer's copy"][k] - lr * silent["gradient"][k]
                     for k in reference["head"]}
        assert_matches(silent["after the step"], step_from, f"{label}, the step from the copy")
        step_from_file = {k: v - lr * silent["gradient"][k] for k, v in reference["head"].items()}
        assert not matches(silent["after the step"], step_from_file), label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
