"""A tied Hugging Face checkpoint loaded into a DeepSpeed pipeline of LayerSpecs, each layer
copying its weights from the file by their Hugging Face names: the head asks for
lm_head.weight, which a tied checkpoint does not hold.

Run on CPU (2 processes, one stage each; with 4, four stages):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/hf_pipeline_loader.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys
import tempfile

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

VOCAB, DIM, LAYERS, SEQ, SEED, LR = 32, 16, 2, 8, 0, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3
DS_CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
             "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0}


def tiny_llama_config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                       num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=SEQ, tie_word_embeddings=True)


def save_tiny_llama():
    """A tied LlamaForCausalLM saved with save_pretrained; the folder, the same on every rank."""
    folder = [tempfile.mkdtemp(prefix="tied-llama-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        torch.manual_seed(SEED)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder[0])
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def micro_batches(device):
    """MICRO_BATCHES (tokens, next tokens) pairs, the same on every rank and step."""
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# --8<-- [start:layers]
def load_from_hf(module, prefix, folder):
    """Copy the module's weights from the Hugging Face file, each under prefix + its name."""
    weights = load_file(os.path.join(folder, "model.safetensors"))
    module.load_state_dict({name: weights[prefix + name] for name in module.state_dict()})


class EmbeddingPipe(nn.Embedding):
    def __init__(self, config, folder):
        super().__init__(config.vocab_size, config.hidden_size)
        load_from_hf(self, "model.embed_tokens.", folder)


class DecoderLayerPipe(nn.Module):
    def __init__(self, config, folder, index):
        super().__init__()
        self.layer = LlamaDecoderLayer(config, index)
        self.rotary = LlamaRotaryEmbedding(config)
        load_from_hf(self.layer, f"model.layers.{index}.", folder)

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        return self.layer(hidden, position_ids=positions,
                          position_embeddings=self.rotary(hidden, positions))


class NormPipe(LlamaRMSNorm):
    def __init__(self, config, folder):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        load_from_hf(self, "model.norm.", folder)


class LMHeadPipe(nn.Linear):
    def __init__(self, config, folder):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        load_from_hf(self, "lm_head.", folder)  # KeyError: not in a tied file


def decoder_specs(config, folder):
    return [LayerSpec(DecoderLayerPipe, config, folder, index)
            for index in range(config.num_hidden_layers)]


def pipeline_config(folder):
    # sdpa: a decoder layer given no mask attends causally (eager would attend everywhere).
    return AutoConfig.from_pretrained(folder, attn_implementation="sdpa")
# --8<-- [end:layers]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    folder = save_tiny_llama()
    # --8<-- [start:main]
    config = pipeline_config(folder)
    layers = [LayerSpec(EmbeddingPipe, config, folder), *decoder_specs(config, folder),
              LayerSpec(NormPipe, config, folder), LayerSpec(LMHeadPipe, config, folder)]
    model = PipelineModule(layers, num_stages=dist.get_world_size(),
                           loss_fn=cross_entropy, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    # --8<-- [end:main]
    # The last stage raises in PipelineModule; the others then wait for it in initialize.
    dist.destroy_process_group()  # never reached


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
