"""snippets/pipeline/accelerate_fsdp2_tied.py: accelerate 1.15.0's FSDP2 preparation of a tied
Llama-shaped model on 2 (and 4) CPU ranks puts the tied weight in one group, trains like one process,
keeps the tie, and saves it once; a checkpoint whose config ties but whose file has both
weights is refused with accelerate's ValueError unless the config is untied; Trainer's fsdp
argument on CPU processes runs DDP."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/accelerate_fsdp2_tied.py"
MAPPING_ERROR = (
    "ValueError: FSDP2 mapping failed (missing: ['lm_head.weight']). This is likely due to tied "
    "embeddings (config has tie_word_embeddings=True but checkpoint has separate weights).\n"
    "To fix, try: Set `model.config.tie_word_embeddings = False` after loading the model.\n")


def train_in_one_process(tie=True):
    """The same model, seed and batches, SGD, without FSDP: the ranks' shares are equal parts
    of the batch, so the mean of their losses and gradients is the whole batch's. Untied, it
    is the checkpoint of the both-weights case as saved."""
    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = ex["transformers"].LlamaForCausalLM(ex["tiny_llama"](tie=tie))
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    losses = []
    for step in range(ex["STEPS"]):
        tokens = ex["batch"](step)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return run_snippet(SNIPPET, request.param, call="main", timeout=300).check()


def test_the_tied_model_trains_like_one_process_and_reloads_tied(run, expect_output):
    ref_losses, ref_weights = train_in_one_process()
    for rank in range(run.world_size):
        got = run.returned(rank)
        assert_matches(got["losses"], ref_losses, f"rank {rank} losses")
        assert got["tie"] == {"one Parameter": True, "max |embed - head|": 0.0}
        # On CPU processes the accelerator says MULTI_CPU again after prepare(), and its
        # get_state_dict returns the shards (DTensors): why the example gathers itself.
        assert got["after prepare"] == {"distributed type": "DistributedType.MULTI_CPU",
                                        "get_state_dict tensors": ["DTensor"]}
        # accelerate's default transformer-based wrap: a group per decoder layer, the tied
        # pair with the final norm in one group, the root holding nothing else.
        assert got["groups"] == [
            (["(root)"], []),
            (["model.norm", "model.embed_tokens", "lm_head"],
             ["model.norm.weight", "model.embed_tokens.weight = lm_head.weight"]),
            (["model.layers.0"], [f"model.layers.0.{n}" for n in LAYER_PARAMS]),
            (["model.layers.1"], [f"model.layers.1.{n}" for n in LAYER_PARAMS]),
        ], got["groups"]
    reloaded = run.returned(0)["reloaded"]
    assert reloaded["saved"] == ["model.embed_tokens.weight"]  # the tie saved once
    assert reloaded["tied"] is True
    assert reloaded["weights"].keys() == ref_weights.keys()
    assert_matches(reloaded["weights"], ref_weights, "reloaded weights")
    if run.world_size == 2:
        expect_output(run, output_file(SNIPPET))


LAYER_PARAMS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def test_a_checkpoint_with_both_weights_under_a_tying_config(run):
    ref_losses, _ = train_in_one_process(tie=False)
    for rank in range(run.world_size):
        checkpoint = run.returned(rank)["checkpoint"]
        # Transformers does not tie the two different weights it found in the file ...
        assert checkpoint["config ties"] == {"tied when loaded": False, "prepared": MAPPING_ERROR}
        # ... and accelerate prepares the model once the config says the same; it then trains
        # with its two weights like the untied model in one process.
        untied = checkpoint["config unties"]
        assert {key: untied[key] for key in ("tied when loaded", "prepared", "two weights")} == {
            "tied when loaded": False, "prepared": True, "two weights": True}
        assert_matches(untied["losses"], ref_losses, f"rank {rank} untied losses")


def test_trainer_fsdp_on_cpu_processes_is_ddp(run):
    for rank in range(run.world_size):
        assert run.returned(rank)["trainer"] == {
            "distributed type": "DistributedType.MULTI_CPU", "FSDP": False,
            "model": "DistributedDataParallel"}
