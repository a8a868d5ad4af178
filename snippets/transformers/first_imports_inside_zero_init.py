"""Which first imports inside `deepspeed.zero.Init` fail as import_inside_zero_init.py
does. Each case below runs in a fresh Python process (one rank): only the first import of
torch._dynamo in a process can fail this way. main() prints each case's outcome.

Run on CPU (1 process; it starts one more Python process per case):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/transformers/first_imports_inside_zero_init.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import re
import socket
import subprocess
import sys

import deepspeed
import torch

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


# Each case runs in its own process (see main), where coverage is not measured.
# --8<-- [start:cases]
def bare_import():  # pragma: no cover - runs in a fresh process
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        import torch._dynamo  # noqa: F401


def compile_a_module():  # pragma: no cover - runs in a fresh process
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = torch.compile(torch.nn.Linear(4, 4))  # torch.compile imports dynamo
    return model


def auto_class(name, config_class, **sizes):
    def build():  # pragma: no cover - runs in a fresh process
        import transformers

        config = getattr(transformers, config_class)(**sizes)
        with deepspeed.zero.Init(config_dict_or_path=ZERO3):
            return getattr(transformers, name).from_config(config)
    return build


def concrete_class():  # pragma: no cover - runs in a fresh process
    import transformers

    config = transformers.GPT2Config(**GPT2)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        return transformers.GPT2LMHeadModel(config)  # its module is imported here


def class_imported_first():  # pragma: no cover - runs in a fresh process
    import transformers
    from transformers import GPT2LMHeadModel  # noqa: F401 - imports modeling_gpt2

    return auto_class("AutoModelForCausalLM", "GPT2Config", **GPT2)()


def dynamo_imported_first():  # pragma: no cover - runs in a fresh process
    import torch._dynamo  # noqa: F401

    return compile_a_module()


def compile_after_the_block():  # pragma: no cover - runs in a fresh process
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = torch.nn.Linear(4, 4)
    return torch.compile(model)
# --8<-- [end:cases]


GPT2 = {"vocab_size": 37, "n_positions": 16, "n_embd": 8, "n_layer": 1, "n_head": 2}
CASES = {
    "import torch._dynamo": bare_import,
    "torch.compile(module)": compile_a_module,
    "AutoModelForCausalLM, GPT-2": auto_class(
        "AutoModelForCausalLM", "GPT2Config", **GPT2),
    "AutoModel, BERT": auto_class(
        "AutoModel", "BertConfig", vocab_size=37, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16),
    "AutoModelForSeq2SeqLM, T5": auto_class(
        "AutoModelForSeq2SeqLM", "T5Config", vocab_size=37, d_model=8, d_ff=16, d_kv=4,
        num_layers=1, num_heads=2),
    "AutoModelForCausalLM, Llama": auto_class(
        "AutoModelForCausalLM", "LlamaConfig", vocab_size=37, hidden_size=8,
        intermediate_size=16, num_hidden_layers=1, num_attention_heads=2),
    "GPT2LMHeadModel(config)": concrete_class,
    "GPT2LMHeadModel imported before, then the Auto class": class_imported_first,
    "import torch._dynamo before, then torch.compile": dynamo_imported_first,
    "torch.compile after the block": compile_after_the_block,
}


def run_case(name):  # pragma: no cover - runs in a fresh process
    """One case in this process: what it raised, or the shape of its first weight."""
    try:
        model = CASES[name]()
    except Exception as error:  # noqa: BLE001 - the error is the outcome
        message = " ".join(str(error).split())
        message = re.sub(r"(?<= at )0x[0-9a-f]+(?=>)", "0x…", message)  # run to run
        print(f"raises {type(error).__name__}: {message}")
    else:
        shape = None if model is None else tuple(next(model.parameters()).shape)
        print("builds" if shape is None else f"builds; first weight {shape}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    outcomes = {}
    for name in CASES:
        # One rank of its own on a new port, in a new interpreter: nothing imported yet.
        # Without torchrun's TORCHELASTIC_* variables: TORCHELASTIC_USE_AGENT_STORE
        # would make it connect to a store on that port that nobody serves, forever.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_PORT=str(free_port()))
        done = subprocess.run([sys.executable, __file__, name], env=env,
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines()
                 if line.startswith(("raises", "builds"))]
        outcomes[name] = lines[-1] if lines else f"exit code {done.returncode}"
        print(f"{name}: {outcomes[name]}")
    return outcomes


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in CASES:
        run_case(sys.argv[1])  # pragma: no cover - the fresh process of one case
    else:
        main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
