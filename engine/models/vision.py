"""A LLaVA model's eyes: images in, language-model embeddings out.

The vision tower is transformers' own (CLIP's or SigLIP's ``*VisionModel``, built from the checkpoint's
``vision_config``): it runs once per image, outside the step's paged attention, so its speed matters far
less than the language model's, and its numbers are transformers' by construction. Its hidden states at
the configured layers (past the class token, unless the strategy is "full") go through the projector
(linear, activation, linear) into the language model's embedding space; ``LlamaForCausalLM.forward``
puts each row where the prompt holds one of the image's placeholder tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import VisionConfig


class LlavaVision(nn.Module):
    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        from transformers import AutoConfig, AutoModel
        from transformers.activations import ACT2FN

        self.cfg = cfg
        tower = AutoConfig.for_model(**cfg.tower)
        self.vision_tower = AutoModel.from_config(tower, attn_implementation="sdpa", dtype=torch.get_default_dtype())
        width = tower.hidden_size * len(cfg.feature_layers)
        self.linear_1 = nn.Linear(width, text_hidden, bias=cfg.projector_bias)
        self.act = ACT2FN[cfg.projector_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=cfg.projector_bias)
        self.unloaded = {n for n, _ in self.named_parameters()}  # until a checkpoint tensor fills them

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) pixels, normalised as the checkpoint's image processor does -> (N, num_tokens, text
        hidden) embeddings."""
        states = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        skip = 0 if self.cfg.keep_cls else 1
        features = torch.cat([states[i][:, skip:] for i in self.cfg.feature_layers], dim=-1)
        return self.linear_2(self.act(self.linear_1(features)))

    def load(self, name: str, w: torch.Tensor) -> bool:
        """Copy a checkpoint tensor named as transformers 4 or 5 name LLaVA's (``vision_tower.*``,
        ``multi_modal_projector.*``, with or without ``model.``) into place; False: not one of ours."""
        name = name.removeprefix("model.")
        if name.startswith("multi_modal_projector."):
            name = name.removeprefix("multi_modal_projector.")
        elif not name.startswith("vision_tower."):
            return False
        try:
            target = self.get_parameter(name)
        except AttributeError:
            return False
        with torch.no_grad():
            target.copy_(w)
        self.unloaded.discard(name)
        return True
