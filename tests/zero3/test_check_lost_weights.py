"""check_lost_weights.py: the checker names the empty copies of nn.TransformerEncoder's layers
and the bias change MultiheadAttention's constructor lost, and the write nn.Embedding(max_norm)
makes in its forward, with fixes; the fixed models (those of copied_layers_fixed.py and
lost_writes.py, which the suite trains against one process) have no findings, and hold the
checker's fix lines as it states them."""

import runpy

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/check_lost_weights.py"
COMPARE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_architectures.py"))
LAYERS = [f"encoder.layers.{i}.{name}" for i in range(2) for name in (
    "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
    "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight",
    "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")]


@pytest.fixture(scope="module")
def checked():
    return run_snippet(SNIPPET, 1, call="main", timeout=600).check()


@pytest.fixture(scope="module")
def found(checked):
    return checked.returned(0)


def source_line(path, number):
    return (ROOT / path).read_text().splitlines()[number - 1].strip()


def test_findings(checked, found, expect_output):  # its output quotes torch's `0.0`
    for name, findings in found.items():
        COMPARE["assert_user_can_write"](findings, name)
    assert found["encoder_fixed"] == [] and found["tagger_fixed"] == []
    encoder = found["encoder"]
    copies = [f for f in encoder if f["kind"] == "copy"]
    assert sorted(f["parameter"] for f in copies) == sorted(LAYERS)
    assert {(f["phase"], f["fix"]) for f in copies} == {
        ("constructor", "with deepspeed.zero.GatheredParameters(layer.parameters()):")}
    (where,) = {f["where"] for f in copies}
    line = int(where.split("`")[1].split(":")[1])
    assert source_line("snippets/zero3/copied_layers.py", line).startswith(
        "self.encoder = nn.TransformerEncoder(layer")
    changed = [f for f in encoder if f["kind"] == "changed"]
    assert [f["parameter"] for f in changed] == [
        "encoder.layers.0.self_attn.out_proj.bias", "encoder.layers.1.self_attn.out_proj.bias"]
    assert {f["fix"] for f in changed} == {
        "with deepspeed.zero.GatheredParameters(layer.self_attn.out_proj.bias, modifier_rank=0):"}
    assert "`constant_(self.out_proj.bias, 0.0)`, its `self` being `layer.self_attn`" in (
        changed[0]["where"])
    assert len(encoder) == len(copies) + len(changed)
    (write,) = found["tagger"]
    assert (write["parameter"], write["reader"], write["phase"], write["kind"]) == (
        "embed.weight", "embed", "forward", "write")
    assert write["fix"] == ("with deepspeed.zero.GatheredParameters(engine.module.embed.weight, "
                            "modifier_rank=0):")
    assert "`embedding_renorm_` makes in `Embedding.forward`" in write["where"]
    expect_output(checked, output_file(SNIPPET))


@marks.findings
def test_the_fixed_models_hold_the_fix_lines_as_stated(found):
    """FixedEncoder runs, in order, the block of the bias change (around what the library
    line did, on `layer.self_attn`) and the block around the line that copies; the loop of
    lost_writes.py renormalises inside the checker's block, then sets the optimizer's copy."""
    fixed = (ROOT / "snippets/zero3/copied_layers_fixed.py").read_text()
    body = fixed[fixed.index("class FixedEncoder"):fixed.index("class FixedDecoder")]
    lines = [line.strip() for line in body.splitlines()]
    by_kind = {f["kind"]: f for f in found["encoder"]}
    bias_block = lines.index(by_kind["changed"]["fix"])
    assert lines[bias_block + 1] == "nn.init.constant_(layer.self_attn.out_proj.bias, 0.0)"
    copy_block = lines.index(by_kind["copy"]["fix"])
    assert copy_block > bias_block
    assert lines[copy_block + 1] == source_line("snippets/zero3/copied_layers.py", int(
        by_kind["copy"]["where"].split("`")[1].split(":")[1]))
    writes = (ROOT / "snippets/zero3/lost_writes.py").read_text()
    loop = [line.strip() for line in writes[writes.index("def renorm_rows"):].splitlines()]
    block = loop.index(found["tagger"][0]["fix"].replace("engine.module.embed.weight", "weight"))
    assert loop[block + 2].startswith("torch.embedding_renorm_(weight,")
    assert any(line.startswith("deepspeed.utils.safe_set_full_fp32_param(weight,")
               for line in loop[block:block + 6])
