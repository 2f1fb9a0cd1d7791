"""Recipe: training the wrapped model of recipes/conv_lm.py, a custom architecture `transformers` loads anywhere.

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --task recipes.conv_lm_task:ConvLMTask

The core's causal-LM task with the model built from `ConvLMConfig` (the task lives apart from the model: the
export copies recipes/conv_lm.py, which must import only torch and transformers).
"""

from __future__ import annotations

from models.language import resolve_block_size
from recipes.conv_lm import ConvLMConfig, ConvLMForCausalLM, register_custom_model
from training.performance import flops_per_token
from training.tasks import CausalLM


class ConvLMTask(CausalLM):
    """The causal-LM task, training `ConvLMForCausalLM` from scratch."""

    can_build_empty = False

    def build_model(self, raw, empty: bool = False) -> ConvLMForCausalLM:
        register_custom_model()
        eos = self.processor.eos_token_id
        vocab_size = -(-len(self.processor) // 64) * 64  # a multiple of 64 keeps the output matmul fast
        model = ConvLMForCausalLM(ConvLMConfig(vocab_size=vocab_size, hidden_size=64, num_layers=2, kernel_size=4,
                                               max_position_embeddings=128, bos_token_id=eos, eos_token_id=eos,
                                               pad_token_id=eos))
        self.block_size = resolve_block_size(self.data_args.block_size, model.config)
        self.flops_per_unit = flops_per_token(model, self.block_size)
        self.settings = {"block_size": self.block_size}
        return model
