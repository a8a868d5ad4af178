"""snippets/zero3/prefetch_inflight.py on 2 and 4 ranks: generation between training steps with a
prompt encoder that the prefill and the scoring forward run and the decoding forwards skip.
On the pinned release it runs to the end, with plain PyTorch's tokens and training losses in
one process. (On DeepSpeed 0.14.5 it stops with "still have inflight params": the version
matrix's run, rendered in snippets/versions/prefetch_inflight.md.)"""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.results import printed_by_the_example
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/prefetch_inflight.py"
EXAMPLE = example_namespace(SNIPPET)


def plain():
    """The same rounds in one process: generate and score, then one SGD step on all sequences."""
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["WithPromptEncoder"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    vocab = EXAMPLE["VOCAB"]
    generated, losses = [], []
    for round_ in range(EXAMPLE["ROUNDS"]):
        model.eval()
        tokens = EXAMPLE["prompts"](round_)
        with torch.no_grad():
            for position in range(EXAMPLE["NEW_TOKENS"]):
                logits = model(tokens, encode_prompt=position == 0)
                tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        model.train()
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        generated.append(tokens)
        losses.append(loss.item())
    return generated, losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_generation_with_a_module_some_forwards_skip(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    generated, losses = plain()
    for rank in range(world_size):
        got = result.returned(rank)
        for round_, (mine, theirs) in enumerate(zip(got["generated"], generated, strict=True)):
            assert torch.equal(mine, theirs), f"rank {rank}, round {round_}"
        assert_matches(got["losses"], losses, f"rank {rank}, training losses")
    assert all(printed_by_the_example(rank.stdout) == "" for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 4 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
