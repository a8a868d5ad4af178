"""snippets/transformers/import_inside_zero_init.py: a GPT-2 Auto class first imported inside
deepspeed.zero.Init raises torch's TypeError on every rank.

The run uses new interpreters (fresh=True): the warm pool's ranks have imported torch._dynamo
already, and there the build succeeds."""

from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/transformers/import_inside_zero_init.py"
# Importing Transformers in new interpreters takes long on a loaded 2-core machine.
TIMEOUT = 600
MESSAGE_START = "Signature mismatch between <function get_new_tensor_fn_for_dtype.<locals>.new_tensor at 0x"
MESSAGE_END = (" and <function tensor_pynew at 0x…>: (cls, *args, **kwargs) -> torch.Tensor != "
               "(cls: type[typing.Any], data: torch.Tensor, requires_grad: bool = False, **kwargs: Any) -> Any")


def test_the_build_raises_torchs_signature_check(expect_output):
    result = run_snippet(SNIPPET, 2, call="main", timeout=TIMEOUT, fresh=True)
    assert not result.ok
    for rank in result.ranks:
        assert rank.exception is not None, rank.cause()
        assert rank.exception["name"] == "TypeError", rank.cause()
        assert rank.exception["message"].startswith(MESSAGE_START), rank.exception["message"]
        assert rank.cause().endswith(MESSAGE_END), rank.cause()
        # The path the page describes: the lazy import of the model's module reaches
        # masking_utils, whose first import of torch._dynamo registers the polyfills.
        traceback = rank.exception["traceback"]
        for frame in ("transformers/models/gpt2/modeling_gpt2.py", "transformers/masking_utils.py",
                      "torch/_dynamo/polyfills/tensor.py", "torch/_dynamo/decorators.py"):
            assert frame in traceback, frame
    expect_output(result, output_file(SNIPPET))
