"""Tiny random Llama target + EAGLE-3 draft + BPE tokenizer, made on the GPU machine in seconds.
Copied from the shared testbed reference (shared/testbed/mk_models.py) for plugin_smoke.sh.

usage: python3 mk_models.py OUTDIR   -> OUTDIR/{target,draft,target_agree,draft_agree}
'agree' variants have final-norm weights zeroed, so target and draft logits are all 0
and both always pick token 0: every draft token is accepted (accept len = steps+1)."""
import glob, json, os, shutil, sys, time
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]; os.makedirs(out, exist_ok=True)
V, H, I, L, NH, KV = 8192, 1024, 2816, 8, 16, 4
DV = 4096  # draft vocab
t0 = time.time()
# ---- tokenizer: byte-level BPE trained on local python sources
files = [f for f in glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))][:400]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tr = trainers.BpeTrainer(vocab_size=V - 3, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train(files, tr)
tok.add_special_tokens(["<s>", "</s>", "<pad>"])  # appended at the end of the vocab
assert tok.get_vocab_size() <= V, tok.get_vocab_size()
bos, eos, pad = tok.token_to_id("<s>"), tok.token_to_id("</s>"), tok.token_to_id("<pad>")
def save_tok(d):
    tok.save(os.path.join(d, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", "model_max_length": 4096, "clean_up_tokenization_spaces": False},
              open(os.path.join(d, "tokenizer_config.json"), "w"))
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
              open(os.path.join(d, "special_tokens_map.json"), "w"))
print(f"tokenizer vocab {tok.get_vocab_size()} in {time.time()-t0:.1f}s", flush=True)
# ---- target
cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                  num_attention_heads=NH, num_key_value_heads=KV, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=pad, rope_theta=10000.0)
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(dev):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
td = os.path.join(out, "target"); m.save_pretrained(td); save_tok(td)
sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
print(f"target saved {sum(v.numel() for v in sd.values())/1e6:.1f}M params {time.time()-t0:.1f}s", flush=True)
# agree variant: zero final norm -> all-zero logits -> argmax token 0 always
ta = os.path.join(out, "target_agree"); os.makedirs(ta, exist_ok=True)
for f in os.listdir(td):
    if not f.endswith(".safetensors"): shutil.copy(os.path.join(td, f), ta)
sd2 = {k: v.contiguous().cpu() for k, v in sd.items()}; sd2["model.norm.weight"] = torch.zeros_like(sd2["model.norm.weight"])
for k in [k for k in os.listdir(td) if k.endswith(".safetensors.index.json")]: os.remove(os.path.join(ta, k))
save_file(sd2, os.path.join(ta, "model.safetensors"), metadata={"format": "pt"})
# ---- EAGLE-3 draft (one decoder layer, input 2H, fc 3H->H, own lm_head over DV tokens, d2t/t2d)
g = torch.Generator().manual_seed(1)
def r(*s): return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
hd = H // NH
w = {
 "midlayer.self_attn.q_proj.weight": r(NH*hd, 2*H), "midlayer.self_attn.k_proj.weight": r(KV*hd, 2*H),
 "midlayer.self_attn.v_proj.weight": r(KV*hd, 2*H), "midlayer.self_attn.o_proj.weight": r(H, NH*hd),
 "midlayer.mlp.gate_proj.weight": r(I, H), "midlayer.mlp.up_proj.weight": r(I, H), "midlayer.mlp.down_proj.weight": r(H, I),
 "midlayer.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
 "midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
 "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
 "norm.weight": torch.ones(H, dtype=torch.bfloat16), "fc.weight": r(H, 3*H), "lm_head.weight": r(DV, H),
 "d2t": torch.zeros(DV, dtype=torch.int64),   # draft id i -> target id i + d2t[i]
 "t2d": torch.cat([torch.ones(DV, dtype=torch.bool), torch.zeros(V-DV, dtype=torch.bool)]),
}
dcfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": 1, "num_attention_heads": NH, "num_key_value_heads": KV,
        "head_dim": hd, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "vocab_size": V, "draft_vocab_size": DV, "tie_word_embeddings": False, "rope_theta": 10000.0,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "torch_dtype": "bfloat16"}
for name, zero in (("draft", False), ("draft_agree", True)):
    d = os.path.join(out, name); os.makedirs(d, exist_ok=True)
    ww = dict(w)
    if zero: ww["norm.weight"] = torch.zeros(H, dtype=torch.bfloat16)
    save_file(ww, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    json.dump(dcfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    save_tok(d)
print(f"done {time.time()-t0:.1f}s; files:", {d: sorted(os.listdir(os.path.join(out, d))) for d in os.listdir(out)}, flush=True)
