"""snippets/transformers/load_under_zero3.py: what a Trainer script builds under ZeRO-3 on the
pinned Transformers, on 2 ranks and on 4. Every from_pretrained gives the checkpoint's weights
(compared here with a load in one process), every from_config builds, and the models built
before TrainingArguments train under Trainer like the same SGD steps in one process, computed
here. What other Transformers releases raise is the version matrix's (its note is checked in
tests/zero3/test_troubleshooting.py and tests/test_versions.py)."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/load_under_zero3.py"
TIMEOUT = 600  # three Trainer runs and twelve loads on a loaded 2-core machine


@pytest.fixture(scope="module")
def example():
    return example_namespace(SNIPPET)


@pytest.fixture(scope="module")
def checkpoints(example):
    """Each tiny model saved as the example saves it, and loaded back in one process."""
    import transformers

    loaded = {}
    for name, (config, _) in example["MODELS"].items():
        directory = example["saved"](name, config())
        model = getattr(transformers, name).from_pretrained(directory)
        loaded[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loaded


def trained_here(example, model):
    """STEPS steps of SGD over every example in one process, written here."""
    tokens = torch.stack([row["input_ids"] for row in example["token_dataset"]()])
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    for _ in range(example["STEPS"]):
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trained(example):
    import transformers

    ex = example
    references = {}
    torch.manual_seed(ex["SEED"])
    gemma = ex["saved"]("Gemma3ForCausalLM", ex["gemma3_text"]())
    references["Gemma3ForCausalLM.from_pretrained before"] = trained_here(
        ex, transformers.Gemma3ForCausalLM.from_pretrained(gemma))
    torch.manual_seed(ex["SEED"])
    references["LlamaForCausalLM(config) before"] = trained_here(
        ex, transformers.LlamaForCausalLM(ex["llama"]()))
    llama = ex["saved"]("LlamaForCausalLM", ex["llama"]())
    references["LlamaForCausalLM.from_pretrained after"] = trained_here(
        ex, transformers.LlamaForCausalLM.from_pretrained(llama))
    return references


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return run_snippet(SNIPPET, request.param, call="main", timeout=TIMEOUT).check()


def test_every_build_works_on_the_pinned_release(run, example, checkpoints, expect_output):
    models = example["MODELS"]
    for rank in range(run.world_size):
        rows = run.returned(rank)
        assert not [label for label, row in rows.items() if "raised" in row], rows.keys()
        for name in models:
            got = rows[f"{name}.from_pretrained"]["returned"]
            assert got["embedding shape"] == (0,)  # partitioned while Transformers initialized
            assert got["weights"].keys() == checkpoints[name].keys()
            for param, tensor in checkpoints[name].items():  # loaded, not initialized anew
                assert torch.equal(got["weights"][param], tensor), (name, param)
        for name, (_, auto_class) in models.items():
            assert rows[f"{name}, {auto_class}.from_config"]["returned"] == {
                "embedding shape": (0,)}
        # DeepSpeed's default threshold changes nothing while zero.Init builds the model.
        for size in ("64 x 16", "8192 x 16"):
            got = rows[f"default threshold, {size} embedding, Gemma3ForCausalLM.from_pretrained"]
            assert got["returned"]["embedding shape"] == (0,), size
        got = rows["default threshold, 64 x 16 embedding, Gemma3ForCausalLM.from_pretrained"]
        for param, tensor in checkpoints["Gemma3ForCausalLM"].items():
            assert torch.equal(got["returned"]["weights"][param], tensor), param
    if run.world_size == 2:
        expect_output(run, output_file(SNIPPET))
    else:  # the same lines on 4 ranks
        assert run.transcript() == output_file(SNIPPET).read_text()


def test_built_before_training_arguments_trains_like_one_process(run, trained):
    for rank in range(run.world_size):
        rows = run.returned(rank)
        for key, reference in trained.items():
            name, order = key.rsplit(" ", 1)
            got = rows[f"{name} {order} TrainingArguments, then Trainer"]["returned"]
            assert got["weights"].keys() == reference.keys(), key
            assert_matches(got["weights"], reference, f"{key}, rank {rank}")
            assert got["trained like one process"] is True, key
