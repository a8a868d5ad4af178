"""snippets/transformers/hybrid_engine.py on 2 ranks: DeepSpeed-Chat's hybrid engine under ZeRO-3
on CPU. For OPT, GPT-2 and Llama, deepspeed.initialize stops while DeepSpeedHybridEngine builds
its inference containers: the inference op has no CPU implementation. For BLOOM the container
refuses the installed Transformers. Qwen2 has no inference policy: the engine is a
DeepSpeedHybridEngine without containers, generate() is the model's own, and the tokens and the
step's loss are plain PyTorch's in one process."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/hybrid_engine.py"
EXAMPLE = example_namespace(SNIPPET)
NO_CPU_OP = "ValueError: This op had not been implemented on CPU backend."
BLOOM = ("RuntimeError: Transformers version 5.24.0 exceeds version 4.43.4! After transformers "
         "version 4.43.4, BLOOM inference with DeepSpeed is no longer supported.")


def plain_qwen2():
    """The same tiny Qwen2 in one process: greedy generate(), then the loss on what it generated."""
    model = EXAMPLE["tiny_model"]("Qwen2ForCausalLM").eval()
    with torch.no_grad():
        tokens = model.generate(EXAMPLE["prompt"](), do_sample=False,
                                max_new_tokens=EXAMPLE["NEW_TOKENS"], pad_token_id=0)
    model.train()
    return tokens[0].tolist(), model(input_ids=tokens, labels=tokens).loss.item()


def test_the_hybrid_engine_on_cpu(expect_output):
    result = run_snippet(SNIPPET, 2, call="main").check()
    tokens, loss = plain_qwen2()
    for rank in range(2):
        got = result.returned(rank)
        assert list(got) == list(EXAMPLE["CONFIGS"])
        for name in ("OPTForCausalLM", "GPT2LMHeadModel", "LlamaForCausalLM"):
            assert got[name]["raised"] == NO_CPU_OP, (rank, name)
            frames = got[name]["frames"]
            # Raised while the hybrid engine builds an inference container for a layer, when
            # the container's attention loads DeepSpeed's inference op.
            assert frames[:1] == ["main"] and "create_inference_module" in frames, frames
            assert "new_inference_container" in frames and frames[-1] == "load", frames
        assert got["BloomForCausalLM"]["raised"] == BLOOM
        assert "create_inference_module" in got["BloomForCausalLM"]["frames"]
        qwen2 = got["Qwen2ForCausalLM"]
        assert qwen2["tokens"] == tokens, rank
        assert_matches(qwen2["loss"], loss, f"rank {rank}, the step's loss")
    # DeepSpeed's own line, on every rank: its workspace op falls back on CPU as well.
    for rank in result.ranks:
        assert "Using fallback functions in workspace because of This op had not been implemented " \
               "on CPU backend." in rank.stdout
    assert "Qwen2ForCausalLM: DeepSpeedHybridEngine with 0 inference containers" in result.ranks[0].stdout
    expect_output(result, output_file(SNIPPET))
