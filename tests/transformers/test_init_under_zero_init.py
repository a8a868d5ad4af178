"""snippets/transformers/init_under_zero_init.py: which weights keep their initialization when
the model is built under ZeRO-3, each parameter against the same model built without
DeepSpeed (same seed), on 2 ranks and on 4; and the verdict rule itself, on draws not made for
the page."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet

SNIPPET = "snippets/transformers/init_under_zero_init.py"
NOT = "NOT as intended"
# GPT-2's constructor under zero.Init: torch's N(0, 1) stays in the embeddings, and the
# residual projections keep Conv1D's std 0.02 instead of GPT-2's 0.02 / sqrt(2 * n_layer).
GPT2_NOT_INITIALIZED = {"transformer.wte.weight", "transformer.wpe.weight",
                        *(f"transformer.h.{layer}.{block}.c_proj.weight"
                          for layer in (0, 1) for block in ("attn", "mlp"))}
FAN_IN_ERROR = ("ValueError: Fan in and fan out can not be computed for tensor with fewer "
                "than 2 dimensions")


def not_as_intended(params):
    return {name for name, stats in params.items() if stats["verdict"] == NOT}


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    # Transformers imports and nine models built twice: a generous bound, well under a hang.
    return run_snippet(SNIPPET, request.param, call="main", timeout=300).check()


def test_which_weights_keep_their_initialization(run, expect_output):
    for rank in range(run.world_size):
        got = run.returned(rank)
        # Your own model: the direct writes in the constructor are lost ...
        assert not_as_intended(got["OwnInit in zero.Init"]) == {"embed.weight", "mixer.bias"}
        # ... both fixes give exactly the model built without DeepSpeed.
        for fixed in ("GatheredInit in zero.Init", "OwnInit, then initialize"):
            assert {s["verdict"] for s in got[fixed].values()} == {"same values"}, fixed
        # GPT-2's constructor inside zero.Init: Transformers' init writes into the empty
        # partitions, with or without an HfDeepSpeedConfig alive.
        for name in ("GPT2LMHeadModel(config) in zero.Init", "the same, HfDeepSpeedConfig alive"):
            assert not_as_intended(got[name]) == GPT2_NOT_INITIALIZED, name
            assert got[name]["transformer.wte.weight"]["std"] > 0.9, name  # torch's N(0, 1)
        # from_config with an HfDeepSpeedConfig initializes every weight (other draws).
        for name in ("GPT-2 from_config", "Gemma 3 from_config", "Gemma 3 AutoModel.from_config"):
            assert "error" not in got[name] and not_as_intended(got[name]) == set(), name
            assert "same distribution" in {s["verdict"] for s in got[name].values()}, name
        # The composite model's constructor inside zero.Init: SigLIP's init needs the shape.
        assert got["Gemma3ForConditionalGeneration(config) in zero.Init"] == {"error": FAN_IN_ERROR}
        assert got == run.returned(0)  # every rank sees the same full weights
    if run.world_size == 2:
        expect_output(run, output_file(SNIPPET))
    else:  # the same table on 4 ranks
        assert run.transcript() == output_file(SNIPPET).read_text()


def draws(init, numel, seed):
    generator = torch.Generator().manual_seed(seed)
    return init(torch.empty(numel, dtype=torch.float64), generator=generator)


@pytest.mark.parametrize("numel", [16, 256, 4096])
def test_the_verdict_tells_other_draws_from_another_initialization(numel):
    """The rule on draws not made for the page: 200 pairs of independent draws of one
    initialization are all 'same distribution'; halving the standard deviation, N(0, 1)
    for N(0, 0.02), or a mean moved by 0.5 std are 'NOT as intended' from 256 values on."""
    verdict = example_namespace(SNIPPET)["verdict"]
    normal = lambda std, mean=0.0: lambda t, generator: t.normal_(mean, std, generator=generator)  # noqa: E731
    uniform = lambda t, generator: t.uniform_(-0.1, 0.1, generator=generator)  # noqa: E731
    for seed in range(100):
        for init in (normal(0.02), uniform):
            want, got = draws(init, numel, 2 * seed), draws(init, numel, 2 * seed + 1)
            assert verdict(got, want) == "same distribution", (numel, seed)
            assert verdict(want.clone(), want) == "same values"
    if numel >= 256:
        want = draws(normal(0.02), numel, 0)
        for other in (normal(0.01), normal(1.0), normal(0.02, mean=0.01)):
            assert verdict(draws(other, numel, 1), want) == NOT, numel
    assert verdict(torch.zeros(numel, dtype=torch.float64) + 1e-3,
                   torch.zeros(numel, dtype=torch.float64)) == NOT  # constants must be equal


def test_fix_1_gathers_one_module_at_a_time(monkeypatch):
    """GatheredInit holds at most one module's own parameters gathered at once (never the
    whole model, which is what zero.Init exists to avoid), and covers every parameter.
    Recorded in one process: GatheredParameters replaced by a recorder of what it is given."""
    import contextlib

    import deepspeed

    ex = example_namespace(SNIPPET)
    calls = []

    @contextlib.contextmanager
    def recorder(params, modifier_rank=None):
        calls.append((list(params), modifier_rank))
        yield

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recorder)
    model = ex["GatheredInit"]()
    owners = {id(p): module for module in model.modules() for p in module.parameters(recurse=False)}
    assert calls, "no gather"
    for params, modifier_rank in calls:
        assert modifier_rank == 0
        assert len({id(owners[id(p)]) for p in params}) <= 1  # one module's own parameters
    gathered = {id(p) for params, _ in calls for p in params}
    assert gathered == {id(p) for p in model.parameters()}
    assert max(len(params) for params, _ in calls) < len(list(model.parameters()))


def test_gathered_parameters_given_a_module_gathers_nothing():
    """DeepSpeed issue #2650 writes GatheredParameters(module, modifier_rank=0). Given a module,
    DeepSpeed's GatheredParameters turns itself off (no gather, no broadcast, no error); given
    the module's parameters it does not. In one process, without a process group: the
    parameters carry a `ds_id`, as zero.Init marks them, and only the decision is checked."""
    import deepspeed

    module = torch.nn.Linear(4, 4)
    for ds_id, param in enumerate(module.parameters()):
        param.ds_id = ds_id
    assert deepspeed.zero.GatheredParameters(module, modifier_rank=0).enabled is False
    # modifier_rank picks the source rank only after this decision, and needs a process group.
    assert deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False))).enabled is True
