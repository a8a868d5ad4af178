"""snippets/transformers/fsdp_save_both_names.py: a tied Llama trained with FSDP2 (2 and 4 CPU ranks),
its full state dict gathered and saved with save_pretrained. The gather gives the two names two
tensors, the file holds both; Transformers reloads it tied (equal values), a tied Megatron
GPTModel refuses it through a plain key mapping; dropping the alias names before the save
writes the weight once. Training and every reload are compared with the same model trained in
this process without FSDP."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/fsdp_save_both_names.py"
TIMEOUT = 300  # Transformers' and Megatron Core's imports on every rank, on a loaded machine
UNEXPECTED = ('RuntimeError: Error(s) in loading state_dict for GPTModel:\n'
              '\tUnexpected key(s) in state_dict: "output_layer.weight". ')


@pytest.fixture(scope="module")
def reference():
    """The same tied model, batch and SGD steps in this one process."""
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = LlamaForCausalLM(ex["tiny_llama_config"](tie=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, losses = ex["batch"](), []
    for _ in range(ex["STEPS"]):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        return losses, model(input_ids=tokens).logits


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_gathered_state_dict_writes_both_names(world_size, reference, expect_output):
    losses, logits = reference
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        # FSDP2 trains the tied model as one process does (3 steps), tie kept.
        assert_matches(got["losses"], losses, f"rank {rank} losses")
        assert_matches(got["logits"], logits, f"rank {rank} logits after training")
        assert got["trained_tied"] is True
        # The gathered full state dict has both names, as two tensors, and the file both keys.
        assert got["both_keys"] == ["lm_head.weight", "model.embed_tokens.weight"]
        # Transformers 5.24.0 ties them again: the two tensors are equal.
        assert got["reloaded_tied"] is True
        assert_matches(got["reloaded_logits"], logits, f"rank {rank} reloaded")
        # Mapped for a tied GPTModel by name, the extra head is refused; the tied mapping loads.
        assert got["refused"] == UNEXPECTED
        assert got["tied mapping"] == "<All keys matched successfully>"
        # named_parameters() lists the tied weight once: the other name is the alias to drop.
        assert got["aliases"] == ["lm_head.weight"]
        assert got["one_keys"] == ["model.embed_tokens.weight"]
        assert got["fixed_tied"] is True
        assert_matches(got["fixed_logits"], logits, f"rank {rank} reloaded after the fix")
    text = result.output
    assert "full state dict: one storage: False, equal: True" in text
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
