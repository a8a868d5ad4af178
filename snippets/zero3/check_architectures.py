"""check_shared_reads.py on real Transformers architectures, against real ZeRO-3 runs.

Each architecture is scaled down through its own config class (tied where the family ties)
and trained 3 steps in three cases: the model alone, with its own loss; a chunked loss that
reads the output head's weight in the training loop; and built by `from_config` while an
`HfDeepSpeedConfig` is alive. Two more are torch's own nn.TransformerEncoder and
nn.TransformerDecoder in a small language model (the first two cases). The checker's verdict
comes from one process; the real run is 2 ranks under ZeRO-3 against the same model in one
process without DeepSpeed.

Run the ZeRO-3 side of two architectures on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/check_architectures.py
Run and tested here on CPU only; not run on GPUs.
"""
import json
import os
import sys
from dataclasses import dataclass

import deepspeed
import torch
import torch.nn.functional as F
import transformers
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn
from transformers.integrations import HfDeepSpeedConfig

from check_shared_reads import DS_CONFIG, _auto_class
from check_shared_reads import apply_fixes, check_shared_reads, loop_fixes
from generated_copies import checker_fixes

VOCAB, SEQ, BATCH, STEPS, LR, SEED, CHUNK = 64, 8, 4, 3, 0.1, 0, 8
SAMPLE = "Llama,T5"  # what the suite runs; the benchmark runs every architecture
CASES = ("model alone", "loss reads the head", "from_config")


# --8<-- [start:configs]
def decoder(config_class, **extra):
    """A small decoder-only config: 2 layers, hidden 16, 2 heads."""
    return config_class(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=SEQ * 2, **extra)


def gemma3_vision():
    text = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=SEQ * 4, sliding_window=4)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=2)
    return transformers.Gemma3Config(text_config=text, vision_config=vision,
                                     mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                     boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)


ARCHITECTURES = {  # name: (model class, its small config, kind of inputs)
    "Llama": ("LlamaForCausalLM", lambda: decoder(transformers.LlamaConfig), "causal"),
    "Qwen3": ("Qwen3ForCausalLM",
              lambda: decoder(transformers.Qwen3Config, head_dim=8, tie_word_embeddings=True),
              "causal"),
    "Mistral": ("MistralForCausalLM", lambda: decoder(transformers.MistralConfig), "causal"),
    "Gemma3": ("Gemma3ForCausalLM",
               lambda: decoder(transformers.Gemma3TextConfig, head_dim=8, sliding_window=4),
               "causal"),
    "Phi-3": ("Phi3ForCausalLM",
              lambda: decoder(transformers.Phi3Config, pad_token_id=0), "causal"),
    "GPT-2": ("GPT2LMHeadModel",
              lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=16,
                                              n_layer=2, n_head=2, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0),
              "causal"),
    "GPT-NeoX": ("GPTNeoXForCausalLM",
                 lambda: transformers.GPTNeoXConfig(
                     vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=SEQ * 2),
                 "causal"),
    "T5": ("T5ForConditionalGeneration",
           lambda: transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                                         num_layers=2, num_heads=2, dropout_rate=0.0,
                                         decoder_start_token_id=0),
           "seq2seq"),
    "BART": ("BartForConditionalGeneration",
             lambda: transformers.BartConfig(
                 vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                 decoder_ffn_dim=32, max_position_embeddings=SEQ * 2, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0),
             "seq2seq"),
    "BERT": ("BertForMaskedLM",
             lambda: transformers.BertConfig(
                 vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=SEQ * 2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             "masked"),
    "Gemma3 vision-language": ("Gemma3ForConditionalGeneration", gemma3_vision, "vision"),
    "nn.TransformerEncoder": ("TorchLM", lambda: TorchConfig("encoder"), "torch"),
    "nn.TransformerDecoder": ("TorchLM", lambda: TorchConfig("decoder"), "torch"),
}
# --8<-- [end:configs]


@dataclass
class TorchConfig:
    stack: str  # "encoder" or "decoder"
    tie_word_embeddings: bool = False


class Output(dict):
    """What the losses read of a model's output: `.loss`, and `.get(...)`."""
    __getattr__ = dict.get


class TorchLM(nn.Module):
    """A small language model on torch's nn.TransformerEncoder or nn.TransformerDecoder,
    written as readers write it; `fixes`: the checker's, applied where they say."""

    def __init__(self, config, fixes=()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, 16)
        encoder = config.stack == "encoder"
        make = nn.TransformerEncoderLayer if encoder else nn.TransformerDecoderLayer
        layer = make(16, 2, 32, dropout=0.0, batch_first=True)
        stack = nn.TransformerEncoder if encoder else nn.TransformerDecoder
        extra = {"enable_nested_tensor": False} if encoder else {}
        with checker_fixes(fixes, locals()):
            self.stack = stack(layer, 2, **extra)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None, output_hidden_states=False):
        hidden = self.embed(input_ids)
        encoder = self.config.stack == "encoder"
        hidden = self.stack(hidden) if encoder else self.stack(hidden, hidden)
        logits = self.head(hidden)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1),
                                                           labels.flatten())
        return Output(loss=loss, logits=logits,
                      hidden_states=(hidden,) if output_hidden_states else None)

    def get_output_embeddings(self):
        return self.head


def model_class(name):
    """The class, imported now: a first import inside zero.Init can fail (see the page)."""
    if ARCHITECTURES[name][2] == "torch":
        return globals()[ARCHITECTURES[name][0]]
    return getattr(transformers, ARCHITECTURES[name][0])


def cases_of(name):
    """The cases an architecture trains: torch's own models have no from_config."""
    return CASES[:2] if ARCHITECTURES[name][2] == "torch" else CASES


def config_of(name):
    return ARCHITECTURES[name][1]()


def batch(name):
    """The whole batch of every step: the model's keyword arguments, labels included."""
    kind = ARCHITECTURES[name][2]
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(4, VOCAB - 4, (BATCH, SEQ), generator=generator)
    if kind == "seq2seq":
        return {"input_ids": tokens, "labels": torch.roll(tokens, 1, dims=1)}
    if kind == "vision":
        config = config_of(name)
        image = [config.boi_token_index] + [config.image_token_index] * 4 + [config.eoi_token_index]
        tokens[:, 1:1 + len(image)] = torch.tensor(image)
        pixels = torch.randn(BATCH, 3, 8, 8, generator=generator)
        return {"input_ids": tokens, "pixel_values": pixels, "labels": tokens,
                "token_type_ids": (tokens == config.image_token_index).long()}
    return {"input_ids": tokens, "labels": tokens}


def shard(inputs, rank, world):
    """This rank's consecutive share of the batch (a strided slice would not be contiguous)."""
    share = BATCH // world
    return {key: value[rank * share:(rank + 1) * share] for key, value in inputs.items()}


# --8<-- [start:losses]
def own_loss(engine, inputs):
    """(a) and (c): the model's own loss."""
    return engine(**inputs).loss


def last_hidden(output):
    """The hidden states the head reads: the decoder's for a seq2seq model."""
    states = output.get("decoder_hidden_states") or output.get("hidden_states")
    return states[-1]


def head_loss(hidden, weight, labels):
    """A chunked cross-entropy: the head's weight is read here, chunk by chunk."""
    hidden, labels = hidden.flatten(0, 1), labels.flatten()
    total = 0.0
    for h, y in zip(hidden.split(CHUNK), labels.split(CHUNK)):
        total = total + F.cross_entropy(F.linear(h, weight), y, reduction="sum")
    return total / labels.numel()


def chunked_loss(engine, inputs):
    """(b): the loss reads the output head's weight outside every forward."""
    output = engine(**inputs, output_hidden_states=True)
    weight = engine.module.get_output_embeddings().weight
    return head_loss(last_hidden(output), weight, inputs["labels"])
# --8<-- [end:losses]


LOSSES = {"model alone": own_loss, "loss reads the head": chunked_loss,
          "from_config": own_loss}


# --8<-- [start:fixed_loop]
def chunked_step_with_fix(engine, inputs, findings):
    """(b) with the checker's fix applied as it says: its GatheredParameters block around
    the line that calls head_loss, and around engine.backward(loss)."""
    output = engine(**inputs, output_hidden_states=True)
    weight = engine.module.get_output_embeddings().weight
    with loop_fixes(findings, engine):
        loss = head_loss(last_hidden(output), weight, inputs["labels"])
        engine.backward(loss)
    return loss
# --8<-- [end:fixed_loop]


def ds_config(world):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


def from_config(name):
    """What the case "from_config" builds (an HfDeepSpeedConfig must be alive)."""
    config = config_of(name)
    auto = _auto_class(model_class(name), config)
    return getattr(transformers, auto).from_config(config)


def builds_from_config(case, findings):
    """Whether this row builds with from_config: its case, or a fix that says so."""
    return case == "from_config" or any(f["fix"].startswith("model = ") for f in findings)


def build(name, case, zero3, findings=()):
    """The model as the case builds it under ZeRO-3; with findings, as their fixes say:
    the line of a constructor fix replaces the build, a registration runs on the model;
    torch's own models apply theirs where they say, in their constructor."""
    cls = model_class(name)
    torch.manual_seed(SEED)
    rebuild = [f["fix"] for f in findings if f["fix"].startswith("model = ")]
    if cls is TorchLM:
        with deepspeed.zero.Init(config_dict_or_path=zero3):
            model = cls(config_of(name), findings)
    elif rebuild:
        names = {"transformers": transformers, "config": config_of(name)}
        exec(rebuild[0], names)
        model = names["model"]
    elif case == "from_config":
        model = from_config(name)
    else:
        with deepspeed.zero.Init(config_dict_or_path=zero3):
            model = cls(config_of(name))
    apply_fixes(model, findings)
    return model


def full_weights(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_grad(param):
    grad = safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def train_zero3(name, case, findings=()):
    """3 steps under ZeRO-3 on this rank's share of the batch: the initial full weights,
    the mean loss of every step and every full gradient, or where it raised what."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    zero3 = ds_config(world)
    keep = HfDeepSpeedConfig(zero3) if builds_from_config(case, findings) else None
    try:
        model = build(name, case, zero3, findings)
    except Exception as error:  # noqa: BLE001 - the result; # pragma: no cover (Gemma3, benchmark only)
        return {"where": "while building the model", "error": f"{type(error).__name__}: {error}"}
    initial = full_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero3)
    inputs = {k: v.to(engine.device) for k, v in shard(batch(name), rank, world).items()}
    losses, grads, weights, where = [], [], [], "in step 0"
    try:
        for step in range(STEPS):
            weights.append(full_weights(engine.module))  # what this step starts from
            where = f"in step {step}"
            if case == "loss reads the head" and findings:
                loss = chunked_step_with_fix(engine, inputs, findings)
            else:
                loss = LOSSES[case](engine, inputs)
                where = f"in backward of step {step}"
                engine.backward(loss)
            grads.append({n: full_grad(p) for n, p in engine.module.named_parameters()})
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"initial": initial, "where": where, "error": f"{type(error).__name__}: {error}"}
    finally:
        del keep
    weights.append(full_weights(engine.module))
    return {"initial": initial, "losses": losses, "grads": grads, "weights": weights, "lr": LR}


class PlainEngine:
    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def steps_plain(name, case, weights, world):
    """Each step again in this one process without DeepSpeed, from the weights the ZeRO-3
    run had at its start: the mean of the losses and of the gradients of the ranks'
    shares, as data parallelism computes them. (From the same weights at every step, the
    rounding of one step does not grow through the next ones.)"""
    model = model_class(name)(config_of(name))
    losses, grads = [], []
    for start in weights[:STEPS]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        total = 0.0
        for rank in range(world):
            loss = LOSSES[case](PlainEngine(model), shard(batch(name), rank, world))
            loss.backward()
            total += loss.item()
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad / world
                      for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        losses.append(total / world)
    return {"losses": losses, "grads": grads}


def initialized_plain(name, from_config_path):
    """The weights the same build gives without DeepSpeed, same seed and the same draws:
    `Class(config)`; or, for from_config under ZeRO-3 (which skips torch's default init and
    then runs Transformers' init once), the model built without any init, filled with
    NaN, then given Transformers' init: a NaN left is a weight that init never writes."""
    torch.manual_seed(SEED)
    if not from_config_path:
        return dict(model_class(name)(config_of(name)).named_parameters())
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = model_class(name)(config_of(name))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    return dict(model.named_parameters())


def head_name(name):
    """The name the output head's weight has in named_parameters (tied: the input's)."""
    model = model_class(name)(config_of(name))
    head = model.get_output_embeddings().weight
    return next(n for n, p in model.named_parameters() if p is head)


def rows():
    """What this run trains: CHECK_ROWS, a JSON list of [architecture, case, findings or
    null]; by default every case of the sample, without fixes."""
    if "CHECK_ROWS" in os.environ:
        return [tuple(row) for row in json.loads(os.environ["CHECK_ROWS"])]
    return [(name, case, None) for name in SAMPLE.split(",") for case in cases_of(name)]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    if rank == 0:  # every architecture's config and batch (the benchmark trains them all)
        for name in ARCHITECTURES:
            config, inputs = config_of(name), batch(name)
            print(f"{name}: {type(config).__name__}, tied {config.tie_word_embeddings}, "
                  f"inputs {', '.join(inputs)}")
    results = []
    for name, case, findings in rows():
        zero3 = train_zero3(name, case, findings or ())
        row = {"architecture": name, "case": case, "fixed": findings is not None,
               "zero3": zero3}
        if rank == 0:  # the references, in this one process
            plain_init = initialized_plain(name, builds_from_config(case, findings or ()))
            row["plain init"] = {n: p.detach().clone() for n, p in plain_init.items()}
            if "weights" in zero3:
                world = torch.distributed.get_world_size()
                row["plain"] = steps_plain(name, case, zero3["weights"], world)
            row["head"] = head_name(name)
            fixed = " (fixed)" if findings is not None else ""
            if "error" in zero3:
                print(f"{name}, {case}{fixed}: fails {zero3['where']}: {zero3['error']}")
            else:
                print(f"{name}, {case}{fixed}: trains, losses",
                      " ".join(f"{x:.4f}" for x in zero3["losses"]))
        results.append(row)
    torch.distributed.destroy_process_group()
    return results


def checker_verdicts():
    """check_shared_reads.py on every row of CHECK_ROWS (one process, its own rank):
    [(architecture, case, findings as dicts, seconds)]."""
    import time

    verdicts = []
    for name, case, _ in rows():
        keep = HfDeepSpeedConfig(DS_CONFIG) if case == "from_config" else None
        cls = model_class(name)  # imported before the checker's zero.Init
        make = (lambda: from_config(name)) if case == "from_config" else (
            lambda: cls(config_of(name)))
        torch.manual_seed(SEED)
        started = time.perf_counter()  # the inputs go to the loop only: the batch as it is
        findings = check_shared_reads(make, batch(name), loop=LOSSES[case])
        verdicts.append((name, case, [vars(f) for f in findings],
                         time.perf_counter() - started))
        del keep
    return verdicts


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
