"""A tied Llama checkpoint converted to Megatron Core's GPTModel and back, by key mapping.

Run on CPU (1 process):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/transformers/convert_tied_megatron.py
(DS_ACCELERATOR is not used here; the command is the one of the DeepSpeed examples.)
Run and tested here on CPU only, over gloo, with transformers 5.24.0 and megatron-core
0.16.1; not run on GPUs.
"""
import logging
import os
import shutil
import sys
import tempfile

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from transformers import LlamaConfig, LlamaForCausalLM

SEED, VOCAB, DIM, LAYERS, HEADS, KV_HEADS, SEQ = 0, 32, 16, 2, 4, 2, 8


def tiny_llama_config(tie=True):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                       tie_word_embeddings=tie)


# --8<-- [start:mapping]
# Megatron Core's names for Hugging Face's Llama names, as Megatron-Bridge's LlamaBridge
# maps them (read from its source); "*" stands for the layer number.
HF_TO_MEGATRON = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.layers.*.input_layernorm.weight": "decoder.layers.*.input_layernorm.weight",
    "model.layers.*.self_attn.o_proj.weight":
        "decoder.layers.*.self_attention.linear_proj.weight",
    "model.layers.*.post_attention_layernorm.weight":
        "decoder.layers.*.pre_mlp_layernorm.weight",
    "model.layers.*.mlp.down_proj.weight": "decoder.layers.*.mlp.linear_fc2.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def per_layer(mapping):
    """The mapping with one entry per layer for each name with a "*"."""
    names = {}
    for hf_name, megatron_name in mapping.items():
        for layer in range(LAYERS) if "*" in hf_name else [None]:
            names[hf_name.replace("*", str(layer))] = megatron_name.replace(
                "*", str(layer))
    return names


def hf_to_megatron(hf, mapping=HF_TO_MEGATRON):
    megatron = {target: hf[source] for source, target in per_layer(mapping).items()}
    for layer in range(LAYERS):  # Megatron fuses Q, K, V and gate, up
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        megatron[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] = merge_qkv(
            *(hf[attn + f"{p}_proj.weight"] for p in "qkv"))
        megatron[f"decoder.layers.{layer}.mlp.linear_fc1.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
    return megatron
# --8<-- [end:mapping]


def merge_qkv(q, k, v):
    """Megatron's fused QKV: for each key/value group, its query heads, its key, its value
    (Megatron-Bridge's merge_qkv_weights)."""
    head_dim = DIM // HEADS
    q = q.view(KV_HEADS, HEADS // KV_HEADS * head_dim, DIM)
    k, v = k.view(KV_HEADS, head_dim, DIM), v.view(KV_HEADS, head_dim, DIM)
    return torch.cat([q, k, v], dim=1).reshape(-1, DIM)


def split_qkv(qkv):
    head_dim = DIM // HEADS
    q, k, v = qkv.view(KV_HEADS, -1, DIM).split(
        [HEADS // KV_HEADS * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, DIM), k.reshape(-1, DIM), v.reshape(-1, DIM)


# --8<-- [start:tied_to_megatron]
def tied_hf_to_megatron(hf, hf_config, shares_head):
    """shares_head: the Megatron model is built with share_embeddings_and_output_weights,
    so it has no output weight of its own."""
    mapping = dict(HF_TO_MEGATRON)
    head = mapping.pop("lm_head.weight")
    megatron = hf_to_megatron(hf, mapping)
    embedding = hf["model.embed_tokens.weight"]
    if not hf_config.tie_word_embeddings:
        megatron[head] = hf["lm_head.weight"]
        return megatron
    # Tied: the file names the weight once. Some files also carry lm_head.weight (a save
    # that gathered both names, some Hub models): the same values, or the file is not tied.
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], embedding):
        raise ValueError("tie_word_embeddings=True, but lm_head.weight differs from the "
                         "embedding: set tie_word_embeddings=False and map it")
    if not shares_head:  # an output layer with a weight of its own: start it tied
        megatron[head] = embedding.clone()
    return megatron
# --8<-- [end:tied_to_megatron]


def megatron_gpt(shares_head):
    """A Megatron Core GPTModel of the tiny Llama's shape (local spec, one stage)."""
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=DIM, ffn_hidden_size=2 * DIM,
        num_attention_heads=HEADS, num_query_groups=KV_HEADS, normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True)
    return GPTModel(config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=shares_head)


# --8<-- [start:load_megatron]
def load_megatron(model, megatron):
    # Megatron's layers also keep an `_extra_state` entry (None in the local spec):
    # take those from the model, then load strictly.
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    return model.load_state_dict({**megatron, **extra}, strict=True)


def megatron_logits(model, hidden):
    """The end of GPTModel.forward: the output layer, given the embedding's weight when
    the model shares it. hidden: [batch, sequence, dim], Hugging Face's layout."""
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights else None)
    logits, _ = model.output_layer(hidden.transpose(0, 1), weight=weight)
    return logits.transpose(0, 1)
# --8<-- [end:load_megatron]


# --8<-- [start:to_hf]
def megatron_to_hf(megatron):
    """Each Megatron name mapped back: whatever the Megatron model holds, nothing more."""
    back = {target: source for source, target in per_layer(HF_TO_MEGATRON).items()}
    hf = {back[name]: tensor for name, tensor in megatron.items() if name in back}
    for layer in range(LAYERS):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        qkv = megatron[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
        for name, part in zip("qkv", split_qkv(qkv)):
            hf[attn + f"{name}_proj.weight"] = part
        gate, up = megatron[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].chunk(2)
        hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"] = gate, up
    return hf


def save_hf(hf, folder, tie=True):
    """What a converter writes: the tensors, and the config that says whether they tie."""
    tensors = {name: tensor.contiguous() for name, tensor in hf.items()}
    os.makedirs(folder, exist_ok=True)
    safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"),
                                metadata={"format": "pt"})
    tiny_llama_config(tie).save_pretrained(folder)
# --8<-- [end:to_hf]


# --8<-- [start:sync]
def sync_weights(model, weights):
    """Copy a trainer's weights, by Hugging Face name, into a live model (the way a
    rollout engine is updated)."""
    params = dict(model.named_parameters())  # a tied weight once, under its first name
    for name, tensor in weights.items():
        params[name].data.copy_(tensor)


def sync_weights_tied(model, weights):
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the embedding's weight, which is copied under its own name
        params[name].data.copy_(tensor)
# --8<-- [end:sync]


class LoggedMessages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def error(call):
    """What call() raised, as `Type: message`."""
    try:
        call()
    except Exception as raised:  # the reader's message, printed
        return f"{type(raised).__name__}: {raised}"
    return None


def layer_outputs(megatron_model, llama, hidden):
    """What the converted decoder layers compute, against the Hugging Face model's (the
    parts of GPTModel that run on CPU: norms, fused Q/K/V projection, MLP)."""
    outputs = []
    for mg_layer, hf_layer in zip(megatron_model.decoder.layers, llama.model.layers):
        normed = mg_layer.input_layernorm(hidden.transpose(0, 1))
        q, k, v = mg_layer.self_attention.get_query_key_value_tensors(normed)
        hf_normed = hf_layer.input_layernorm(hidden)
        attn = hf_layer.self_attn
        outputs.append({
            "norm": (normed.transpose(0, 1), hf_normed),
            "q": (q.flatten(2).transpose(0, 1), attn.q_proj(hf_normed)),
            "k": (k.flatten(2).transpose(0, 1), attn.k_proj(hf_normed)),
            "v": (v.flatten(2).transpose(0, 1), attn.v_proj(hf_normed)),
            "mlp": (mg_layer.mlp(normed)[0].transpose(0, 1), hf_layer.mlp(hf_normed)),
        })
    return outputs


def file_variants(llama, workdir):
    """from_pretrained on each file a converter may write: embedding only, both names
    (equal or not), head only; with a config that ties and one that does not."""
    state = {k: v.detach().clone() for k, v in llama.state_dict().items()}
    embedding = state.pop("model.embed_tokens.weight")
    head = state.pop("lm_head.weight")
    files = {
        "embedding only": {"model.embed_tokens.weight": embedding},
        "both, equal": {"model.embed_tokens.weight": embedding, "lm_head.weight": head},
        "both, different": {"model.embed_tokens.weight": embedding,
                            "lm_head.weight": head * 2},
        "head only": {"lm_head.weight": head},
    }
    logged = LoggedMessages()
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(logged)
    rows = []
    for holds, names in files.items():
        for tie in (True, False):
            folder = tempfile.mkdtemp(prefix="variant-", dir=workdir)
            save_hf({**state, **names}, folder, tie)
            logged.messages.clear()
            model = LlamaForCausalLM.from_pretrained(folder)

            def source(weight):
                found = [n for n, t in names.items() if torch.equal(weight, t)]
                return " = ".join(found) if found else "new"
            rows.append({
                "file": holds, "config ties": tie,
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "head": source(model.lm_head.weight),
                "embedding": source(model.model.embed_tokens.weight),
                "logged": [m.replace("\x1b[1m", "").replace("\x1b[0m", "")
                           .replace(folder, "<folder>") for m in logged.messages]})
    logger.removeHandler(logged)
    return rows


def main():
    dist.init_process_group()  # no backend named: gloo for CPU tensors
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    transformers.logging.disable_progress_bar()
    results = {}
    # --8<-- [start:file]
    torch.manual_seed(SEED)
    llama = LlamaForCausalLM(tiny_llama_config(tie=True))  # tie_word_embeddings=True
    workdir = tempfile.mkdtemp(prefix="convert-")
    folder = os.path.join(workdir, "tied-llama")
    llama.save_pretrained(folder)
    hf = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    state = llama.state_dict()
    print(f"saved: lm_head.weight in the file: {'lm_head.weight' in hf}")
    print("state_dict(): both names, one storage: "
          f"{state['lm_head.weight'].data_ptr() == state['model.embed_tokens.weight'].data_ptr()}")
    print("named_parameters(): "
          f"{[n for n, _ in llama.named_parameters() if 'embed' in n or 'head' in n]}")
    # --8<-- [end:file]
    results["file keys"] = sorted(hf)
    # --8<-- [start:naive]
    naive = error(lambda: hf_to_megatron(hf))
    print(f"hf_to_megatron: {naive}")
    # --8<-- [end:naive]
    results["naive"] = naive

    # --8<-- [start:megatron]
    megatron_model = megatron_gpt(shares_head=True).eval()
    loaded = load_megatron(megatron_model, tied_hf_to_megatron(hf, llama.config, True))
    print(f"tied_hf_to_megatron, strict load: {loaded}")
    print("GPTModel(share_embeddings_and_output_weights=True): output_layer.weight is "
          f"{megatron_model.output_layer.weight}; in its state_dict: "
          f"{'output_layer.weight' in megatron_model.state_dict()}")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = llama.model(tokens).last_hidden_state
        same = torch.allclose(megatron_logits(megatron_model, hidden),
                              llama.lm_head(hidden), rtol=1e-5, atol=1e-6)
    print(f"Megatron's output layer on Hugging Face's last hidden state: same logits: {same}")
    # --8<-- [end:megatron]
    with torch.no_grad():
        results["embeddings"] = (megatron_model.embedding(input_ids=tokens, position_ids=None)
                                 .transpose(0, 1), llama.model.embed_tokens(tokens))
        results["logits, shared head"] = (megatron_logits(megatron_model, hidden),
                                          llama.lm_head(hidden))
        results["layers"] = layer_outputs(megatron_model, llama, results["embeddings"][1])
    results["loaded"] = str(loaded)
    results["output_layer.weight"] = megatron_model.output_layer.weight
    results["megatron keys"] = sorted(megatron_model.state_dict())
    forward = error(lambda: megatron_model(input_ids=tokens, position_ids=None,
                                           attention_mask=None))
    print(f"GPTModel forward on CPU: {forward}")
    results["forward"] = forward

    own_head = megatron_gpt(shares_head=False).eval()
    load_megatron(own_head, tied_hf_to_megatron(hf, llama.config, False))
    with torch.no_grad():
        results["logits, own head"] = (megatron_logits(own_head, hidden),
                                       llama.lm_head(hidden))
    results["own head is a copy"] = (
        own_head.output_layer.weight.data_ptr()
        != own_head.embedding.word_embeddings.weight.data_ptr())
    print("GPTModel(share_embeddings_and_output_weights=False), output layer from the "
          f"embedding: same logits: {torch.allclose(*results['logits, own head'])}")

    # --8<-- [start:both_names]
    both = dict(hf, **{"lm_head.weight": hf["model.embed_tokens.weight"].clone()})
    unexpected = error(lambda: load_megatron(megatron_gpt(True), hf_to_megatron(both)))
    print(f"a file with both names, hf_to_megatron, strict load: {unexpected}")
    fixed = load_megatron(megatron_gpt(True), tied_hf_to_megatron(both, llama.config, True))
    print(f"the same file, tied_hf_to_megatron: {fixed}")
    # --8<-- [end:both_names]
    results["unexpected"], results["both names fixed"] = unexpected, str(fixed)
    differs = dict(hf, **{"lm_head.weight": hf["model.embed_tokens.weight"] * 2})
    results["differs"] = error(lambda: tied_hf_to_megatron(differs, llama.config, True))
    print(f"lm_head.weight that differs, tied_hf_to_megatron: {results['differs']}")
    # The same file with a config that does not tie: the head is mapped, no error.
    untied = tiny_llama_config(tie=False)
    results["untied error"] = error(lambda: tied_hf_to_megatron(differs, untied, False))
    results["untied"] = tied_hf_to_megatron(differs, untied, False)

    # --8<-- [start:back]
    converted = megatron_to_hf(megatron_model.state_dict())
    print(f"megatron_to_hf: lm_head.weight in it: {'lm_head.weight' in converted}")
    back = os.path.join(workdir, "from-megatron")
    save_hf(converted, back)
    reloaded = LlamaForCausalLM.from_pretrained(back)
    with torch.no_grad():
        same = torch.allclose(reloaded(tokens).logits, llama(tokens).logits,
                              rtol=1e-5, atol=1e-6)
    tied = reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    print(f"  from_pretrained: lm_head.weight is embed_tokens.weight: {tied}; "
          f"same logits as the original: {same}")
    strict = error(lambda: LlamaForCausalLM(tiny_llama_config()).load_state_dict(converted))
    print(f"  load_state_dict: {strict}")
    # --8<-- [end:back]
    with torch.no_grad():
        results["round trip logits"] = (reloaded(tokens).logits, llama(tokens).logits)
    results["round trip tied"], results["missing"] = tied, strict
    results["converted keys"] = sorted(converted)
    # --8<-- [start:back_fix]
    model = LlamaForCausalLM(tiny_llama_config())
    named = dict(converted, **{"lm_head.weight": converted["model.embed_tokens.weight"]})
    loaded = model.load_state_dict(named)
    print(f"  load_state_dict, the embedding named for lm_head too: {loaded}; tied: "
          f"{model.lm_head.weight is model.model.embed_tokens.weight}")
    # --8<-- [end:back_fix]
    with torch.no_grad():
        results["load_state_dict logits"] = (model(tokens).logits, llama(tokens).logits)
    results["load_state_dict tied"] = model.lm_head.weight is model.model.embed_tokens.weight

    # --8<-- [start:sync_run]
    trainer_weights = megatron_to_hf(own_head.state_dict())  # has lm_head.weight
    rollout = LlamaForCausalLM(tiny_llama_config())
    print(f"sync_weights: {error(lambda: sync_weights(rollout, trainer_weights))}")
    sync_weights_tied(rollout, trainer_weights)
    print("sync_weights_tied: lm_head.weight is embed_tokens.weight: "
          f"{rollout.lm_head.weight is rollout.model.embed_tokens.weight}")
    # --8<-- [end:sync_run]
    results["sync"] = error(lambda: sync_weights(LlamaForCausalLM(tiny_llama_config()),
                                                 trainer_weights))
    with torch.no_grad():
        results["sync logits"] = (rollout(tokens).logits, llama(tokens).logits)
    results["sync tied"] = rollout.lm_head.weight is rollout.model.embed_tokens.weight

    results["variants"] = file_variants(llama, workdir)
    print("from_pretrained, by what the file holds and what the config says:")
    for row in results["variants"]:
        print(f"  {row['file']}, tie_word_embeddings={row['config ties']}: "
              f"tied {row['tied']}; lm_head.weight from {row['head']}, "
              f"embed_tokens.weight from {row['embedding']}")
        for message in row["logged"]:
            print("    logged: " + message.replace("\n", "\n    "))
    shutil.rmtree(workdir)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
