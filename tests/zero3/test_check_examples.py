"""check_examples.py: the checker on the pages' models and on a tiny Hugging Face GPT-2, one
process; the findings it returns and the output the page shows."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/zero3/check_examples.py"


@marks.findings
def test_findings_on_the_pages_examples(expect_output):
    result = run_snippet(SNIPPET, 1, call="main", timeout=600).check()
    found = result.returned(0)
    assert found["language_model"] == []
    assert found["module_z3_without_registration"] == []
    assert [(f["parameter"], f["reader"], f["phase"], f["step"]) for f in
            found["tied_through_a_list"]] == [("embeddings.weight", "(model)", "forward", 0)]
    assert [(f["parameter"], f["reader"], f["phase"]) for f in
            found["loss_reads_the_weight"]] == [("embeddings.weight", "(outside any forward)", "loop")]
    # Transformers' own weight initialisation writes the partitioned weights: constructor
    # findings only; the forward, backward and loop read nothing ZeRO-3 did not gather.
    gpt2 = found["tiny_gpt2"]
    assert gpt2 and {f["phase"] for f in gpt2} == {"constructor"}
    assert "transformer.wte.weight" in {f["parameter"] for f in gpt2}
    expect_output(result, output_file(SNIPPET))
