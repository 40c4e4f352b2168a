"""Qwen2MoeForCausalLM as an EAGLE-3 target on SGLang 0.5.17 (testbed code, registered under SGLang's name for the MoE
testbed target): adds the get_embed_and_head the EAGLE-3 worker calls, and builds the config's mlp_only_layers dense
(build_moe.py --tail), which 0.5.17 ignores; a config naming dense layers that were not built refuses to start."""

import logging

import sglang.srt.models.qwen2_moe as _q
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM as _SGLangQwen2Moe
from sglang.srt.models.qwen2_moe import Qwen2MoeMLP

log = logging.getLogger(__name__)


class DenseTailMLP(Qwen2MoeMLP):
    """Qwen2-MoE's dense MLP called as the sparse block is: (hidden_states, forward_batch)."""

    def forward(self, x, forward_batch=None, *args, **kwargs):
        return super().forward(x)


class Qwen2MoeForCausalLM(_SGLangQwen2Moe):
    def __init__(self, config, quant_config=None, prefix=""):
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        sparse_block = _q.Qwen2MoeSparseMoeBlock

        def block(layer_id, config, quant_config=None, prefix="", **kwargs):
            if layer_id in dense:
                # reduce_results as the sparse block was asked (0.5.23 reduces in the layer communicator)
                return DenseTailMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                    hidden_act=config.hidden_act, quant_config=quant_config, prefix=prefix,
                                    reduce_results=kwargs.get("reduce_results", True))
            return sparse_block(layer_id=layer_id, config=config, quant_config=quant_config, prefix=prefix, **kwargs)

        _q.Qwen2MoeSparseMoeBlock = block if dense else sparse_block
        try:
            super().__init__(config, quant_config=quant_config, prefix=prefix)
        finally:
            _q.Qwen2MoeSparseMoeBlock = sparse_block
        built = {i for i, layer in enumerate(self.model.layers)
                 if isinstance(getattr(layer, "mlp", None), DenseTailMLP)}
        if built != dense:
            raise RuntimeError(f"mlp_only_layers {sorted(dense)} but dense MLPs built at {sorted(built)}")
        if dense:
            log.info("specctl testbed: %d of %d layers dense (mlp_only_layers %d-%d)", len(dense),
                     len(self.model.layers), min(dense), max(dense))

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight


EntryClass = Qwen2MoeForCausalLM
