"""A V-shaped schedule puts the first and the last stage on one rank: the tied embedding and
head are one tensor there, trained without any all_reduce, equal to one process."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/torch_tied_v.py"


def reference():
    ex = example_namespace(SNIPPET)
    layers = ex["build_model"]()
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for x, y in zip(tokens.tensor_split(ex["MICRO_BATCHES"]), targets.tensor_split(ex["MICRO_BATCHES"])):
            out = x
            for layer in layers:
                out = layer(out)
            loss = ex["cross_entropy"](out, y)
            (loss / ex["MICRO_BATCHES"]).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / ex["MICRO_BATCHES"])
    return losses, {f"{i}.{name}": p.detach().clone() for i, layer in enumerate(layers)
                    for name, p in layer.named_parameters()}


def test_v_schedule_keeps_the_tie_as_one_tensor_and_matches_one_process(expect_output):
    result = run_snippet(SNIPPET, 2, call="main", timeout=300).check()
    ref_losses, ref_parameters = reference()
    rank0, rank1 = result.returned(0), result.returned(1)
    assert rank0["mine"] == [0, 3] and rank1["mine"] == [1, 2]
    assert rank0["one_tensor"] is True
    # Rank 0 holds the tied weight once (16 x 8 float32 = 512 bytes) for both of its stages;
    # rank 1 holds none of it.
    assert rank0["bytes"] == [[512, 1], [576, 4]]
    for got in (rank0, rank1):
        assert_matches(got["losses"], ref_losses, "losses")
        for name, value in got["parameters"].items():
            assert_matches(value, ref_parameters[name])
    print(f"{SNIPPET}: {result.seconds:.1f} s on 2 ranks")
    expect_output(result, output_file(SNIPPET))
