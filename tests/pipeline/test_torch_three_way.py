"""snippets/pipeline/torch_three_way.py: the encoder+decoder tie (one weight used three times, on three
stages) with torch.distributed.pipelining: one all_reduce over the three holding stages, equal
to one process."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_gpipe_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches


TORCH = "snippets/pipeline/torch_three_way.py"


def torch_reference():
    ex = example_namespace(TORCH)
    torch.manual_seed(ex["SEED"])
    model = ex["EncoderDecoder"]()
    losses, first_grad = train_gpipe_in_one_process(ex, model, model.encoder_embed.weight)
    return losses, first_grad, model


def test_pipelining_three_way_tie_sums_three_shares(expect_output):
    result = run_snippet(TORCH, 3, call="main", timeout=300).check()
    ref_losses, ref_first_grad, model = torch_reference()
    for rank in range(3):
        got = result.returned(rank)
        # pipelining names one copy per stage: three tensors for one weight.
        assert got["uses"] == {"submod_pp_0": "encoder_embed.weight", "submod_pp_1": "decoder_embed.weight",
                               "submod_pp_2": "head.weight"}
        assert_matches(got["losses"], ref_losses, "losses")
        # The tied gradient is the sum of all three shares; no share and no pair of shares is.
        shares = got["first_shares"]
        assert_matches(sum(shares), ref_first_grad)
        for partial in (*shares, shares[0] + shares[1], shares[1] + shares[2], shares[0] + shares[2]):
            assert not matches(partial, ref_first_grad)
        assert all(torch.equal(copy, got["copies"][0]) for copy in got["copies"])
        assert_matches(got["weight"], model.encoder_embed.weight.detach())
    print(f"{TORCH}: {result.seconds:.1f} s on 3 ranks")
    expect_output(result, output_file(TORCH))
