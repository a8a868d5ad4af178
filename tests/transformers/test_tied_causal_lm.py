"""snippets/transformers/tied_causal_lm.py: a tied causal LM trained with Trainer under ZeRO-3 and
saved with save_model, reloaded here with from_pretrained in one process without DeepSpeed: the
tie is kept, the weights are those of the same training in plain PyTorch, and the logits and
greedy generation are the run's. Then the two broken-tie cases and their fixes."""

import pytest
import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/tied_causal_lm.py"
TIMEOUT = 600  # two Trainer runs and Transformers' import on a loaded 2-core machine
SHARED_MESSAGE = "RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk"
GATHER_OFF = ("stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, "
              "use zero_to_fp32.py to recover weights")


UNTIED = "but both are present in the checkpoints with different values, so we will NOT tie them"


@pytest.fixture(scope="module")
def reference():
    """The same model, data and SGD in one process: one step over every example, STEPS steps."""
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET)
    model = LlamaForCausalLM.from_pretrained(ex["save_tiny_llama"]())
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    inputs = torch.stack([example["input_ids"] for example in ex["token_dataset"]()])
    losses = []
    for _ in range(ex["STEPS"]):
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return ex, model, inputs, losses


def greedy(model, inputs):
    return model.generate(inputs[:, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_save_model_then_from_pretrained_in_one_process(world_size, reference, expect_output):
    from transformers import LlamaForCausalLM

    ex, trained, inputs, _ = reference
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    got = result.returned(0)
    assert got["files"] == ["model.safetensors", "training_args.bin"]
    # The tied head is saved once, under the embedding's name.
    assert "lm_head.weight" not in got["keys"] and "model.embed_tokens.weight" in got["keys"]
    reloaded = LlamaForCausalLM.from_pretrained(got["saved"])
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight
    assert_matches(reloaded.state_dict(), trained.state_dict(), "reloaded weights")
    with torch.no_grad():
        logits = reloaded(input_ids=inputs).logits
        assert_matches(logits, trained(input_ids=inputs).logits, "logits against plain PyTorch")
    for rank in range(world_size):
        assert_matches(result.returned(rank)["logits"], logits, f"rank {rank} ZeRO-3 logits")
    assert torch.equal(greedy(reloaded, inputs), greedy(trained, inputs))
    # stage3_gather_16bit_weights_on_model_save false: save_model writes no model weights.
    assert "model.safetensors" not in got["gather_off"]["files"]
    assert {"global_step3", "zero_to_fp32.py"} <= set(got["gather_off"]["files"])
    assert any(GATHER_OFF in message for message in got["gather_off"]["warnings"])
    broken = got["broken"]
    # safetensors' save_file refuses the two names of one storage; its save_model keeps one.
    assert broken["save_file"].startswith(SHARED_MESSAGE)
    assert "[{'lm_head.weight', 'model.embed_tokens.weight'}]" in broken["save_file"]
    assert "lm_head.weight" in broken["save_model_keys"]
    assert "model.embed_tokens.weight" not in broken["save_model_keys"]
    # safetensors.torch.load_model fills both names of a fresh tied model from that file.
    assert broken["load_model"] == {"tied": True, "weights equal the saved model's": True}
    # A head untied by the reader's code is saved under both names and reloaded untied, with
    # a warning until the config says so.
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(broken["untied_keys"])
    assert broken["untied_reloaded"] == {"tied": False, "head equals the saved head": True}
    assert any(UNTIED in message for message in broken["untied_warnings"])
    assert broken["fixed_keys"] == broken["untied_keys"]
    assert broken["fixed_reloaded"] == {"tied": False, "head equals the saved head": True}
    assert not any(UNTIED in message for message in broken["fixed_warnings"])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks Trainer's steps would take 6 of the 8 examples, then 2: other steps and another
    checkpoint than the page's. The example says so instead."""
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 8 examples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the saved model was checked on both)"))
