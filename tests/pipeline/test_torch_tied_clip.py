"""snippets/pipeline/torch_tied_clip.py: clipping by hand on 2 torch.distributed.pipelining stages
matches one process only when the stages' squares are summed, the tie counted once."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, gradient_norm
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches


TORCH = "snippets/pipeline/torch_tied_clip.py"


def torch_reference():
    ex = example_namespace(TORCH)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses, norms, shares = [], [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for x, y in zip(tokens.tensor_split(ex["MICRO_BATCHES"]), targets.tensor_split(ex["MICRO_BATCHES"])):
            loss = ex["cross_entropy"](model(x), y)
            (loss / ex["MICRO_BATCHES"]).backward()
            total += loss.item()
        # What each stage sees of it when clipping alone: the tie (summed) plus its own mixer.
        shares.append((gradient_norm([model.embed.weight, *model.mixer1.parameters()]),
                       gradient_norm([model.embed.weight, *model.mixer2.parameters()])))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), ex["CLIP"]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / ex["MICRO_BATCHES"])
    return losses, norms, shares, model


def test_manual_clipping_matches_one_process_only_with_the_whole_model_norm(expect_output):
    result = run_snippet(TORCH, 2, call="main", timeout=300).check()
    ref_losses, ref_norms, ref_stage_norms, model = torch_reference()
    for rank in range(2):
        whole, each = result.returned(rank)["whole model"], result.returned(rank)["each stage"]
        # Whole-model norm: both stages clip by clip_grad_norm_'s norm; training is one process's.
        assert_matches([n0 for n0, _ in whole["norms"]], ref_norms, "whole-model norms")
        assert all(n0 == n1 for n0, n1 in whole["norms"])
        assert_matches(whole["losses"], ref_losses, "whole losses")
        assert whole["copies_equal"]
        assert_matches(whole["weight"], model.embed.weight.detach())
        # Each stage alone: its norm counts the (summed) tied gradient and its own mixer only,
        # so the stages clip by different factors, the copies part, training differs.
        assert_matches(each["norms"][0], list(ref_stage_norms[0]), "each norms 0")
        assert not matches(each["norms"][0][0], each["norms"][0][1])
        assert not matches(each["losses"][-1], ref_losses[-1])
        assert not each["copies_equal"]
    print(f"{TORCH}: {result.seconds:.1f} s on 2 ranks")
    expect_output(result, output_file(TORCH))
