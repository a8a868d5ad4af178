"""snippets/transformers/first_imports_inside_zero_init.py: which first imports inside
deepspeed.zero.Init raise torch's TypeError. Each case runs in a new interpreter that the
snippet starts, so the warm pool's imports do not reach it. The cases run once per session, in
the documented torchrun command (rankrun.pages.RUN_BY_TORCHRUN): every test here, the output
test and the versions page's row read that run."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import check_torchrun, documented_run, printed_by_the_example, run_torchrun

SNIPPET = "snippets/transformers/first_imports_inside_zero_init.py"
TIMEOUT = 900  # ten new interpreters, most of them importing Transformers
RAISES = ("raises TypeError: Signature mismatch between <function get_new_tensor_fn_for_dtype."
          "<locals>.new_tensor at 0x…> and <function tensor_pynew at 0x…>: ")
FAILS = ["import torch._dynamo", "torch.compile(module)", "AutoModelForCausalLM, GPT-2",
         "AutoModel, BERT", "AutoModelForSeq2SeqLM, T5", "AutoModelForCausalLM, Llama",
         "GPT2LMHeadModel(config)"]
BUILDS = {"GPT2LMHeadModel imported before, then the Auto class": "builds; first weight (0,)"}
# torch.compile inside zero.Init fails even when torch._dynamo was imported before, for another
# reason: DeepSpeed's constructor wrapper asks OptimizedModule for an attribute before its
# __init__ has set _orig_mod, and OptimizedModule.__getattr__ recurses.
COMPILE = {"import torch._dynamo before, then torch.compile": "raises RecursionError: maximum recursion depth exceeded",
           "torch.compile after the block": "builds; first weight (0,)"}


def printed_outcomes(output: str) -> dict[str, str]:
    """What main() printed, one `case: outcome` line per case, in order (a case has no ': ')."""
    return dict(line.split(": ", 1) for line in output.splitlines())


@marks.first_imports
def test_each_first_import_inside_zero_init(expect_output):
    result = documented_run(SNIPPET, timeout=TIMEOUT).check()
    outcomes = printed_outcomes(result.output)
    assert list(outcomes) == FAILS + list(BUILDS) + list(COMPILE)
    for case in FAILS:
        assert outcomes[case].startswith(RAISES), (case, outcomes[case])
    for case, outcome in {**BUILDS, **COMPILE}.items():
        assert outcomes[case] == outcome, (case, outcomes[case])
    expect_output(result, output_file(SNIPPET))


@marks.first_imports
def test_the_documented_torchrun_command_prints_the_same():
    """Under real torchrun, whose TORCHELASTIC_* variables a case's new interpreter would inherit
    (TORCHELASTIC_USE_AGENT_STORE made each case wait forever for a store nobody serves)."""
    done = check_torchrun(run_torchrun(SNIPPET, 1, timeout=TIMEOUT))
    assert printed_by_the_example(done.stdout) == output_file(SNIPPET).read_text()
