"""Qwen2MoeForCausalLM as an EAGLE-3 target on SGLang 0.5.17, whose class lacks get_embed_and_head (the EAGLE-3
worker calls it at start-up to share the target's embedding with the draft). Testbed code, not the product:
registered under the same architecture name, it replaces SGLang's class for the MoE testbed target only."""

from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM as _SGLangQwen2Moe


class Qwen2MoeForCausalLM(_SGLangQwen2Moe):
    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight


EntryClass = Qwen2MoeForCausalLM
