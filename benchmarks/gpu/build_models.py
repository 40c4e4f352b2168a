"""Build the testbed's target models (runs on the GPU machine; CPU works too, slowly).

  python3 build_models.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/m [--variants 1b,8b] [--check 20]

-> OUT/base            bf16 HF safetensors of SmolLM2-135M-Instruct (GGUF Q4_1/Q8_0 dequantized exactly as
                       transformers' GGUF loader does), tokenizer + chat template from the GGUF
   OUT/<variant>       the same model with zero-padded capacity: MLP intermediate widened with zero rows
                       (gate/up) and zero columns (down), extra decoder layers appended whose o_proj and
                       down_proj are zero (so each is the identity on the residual stream). Every logit is
                       unchanged; the step cost grows like a bigger model's.
   OUT/models.json     dims, params, and the greedy-identity check (HF, bf16, batched, --check prompts)

Variants (name: intermediate, layers): see VARIANTS. Extra layers are appended AFTER the 30 real ones,
so the EAGLE-3 aux hidden states (outputs of layers 1, 14, 26) are the same in every variant; the draft
config pins them explicitly (eagle_aux_hidden_state_layer_ids), since SGLang's default depends on depth.
"""
import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prompts import chat_ids  # noqa: E402

VARIANTS = {"1b": (16384, 36), "8b": (65536, 70), "5b": (49152, 60)}
CHECK_PROMPTS = [
    "What is the capital of France?", "Write a Python function that reverses a string.",
    "Explain gravity to a child in two sentences.", "List three fruits that are red.", "How do I boil an egg?",
    "What is photosynthesis?", "Give me a haiku about the sea.", "Why is the sky blue?",
    "Summarize the plot of Cinderella.", "What is a prime number?", "How does a bicycle work?",
    "Name the planets of the solar system.", "What is machine learning?", "Translate 'good morning' into Spanish.",
    "What are the benefits of exercise?", "Describe a cat in one paragraph.",
    "Write a Python function to check whether a number is prime.", "What causes rain?",
    "Give three tips for writing a good essay.", "Write a SQL query that counts the rows of a table named users.",
]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rperm(w, n):  # transformers' LlamaTensorProcessor._reverse_permute_weights (GGUF q/k row order -> HF)
    d = w.shape[0] // n // 2
    return w.reshape(n, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


MAP = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
       "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
       "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def read_gguf(path):
    from gguf import GGUFReader, dequantize
    r = GGUFReader(path)

    def field(k):
        f = r.fields[k]
        return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else None

    dims = dict(H=field("llama.embedding_length"), I=field("llama.feed_forward_length"), L=field("llama.block_count"),
                NH=field("llama.attention.head_count"), KV=field("llama.attention.head_count_kv"),
                eps=float(field("llama.attention.layer_norm_rms_epsilon")), theta=float(field("llama.rope.freq_base")),
                ctx=field("llama.context_length"), V=len(r.fields["tokenizer.ggml.tokens"].data))
    try:
        f = r.fields["tokenizer.chat_template"]
        dims["chat_template"] = bytes(f.parts[f.data[0]]).decode()
    except Exception:
        dims["chat_template"] = None
    sd = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        n = t.name
        if n == "token_embd.weight":
            k = "model.embed_tokens.weight"
        elif n == "output_norm.weight":
            k = "model.norm.weight"
        elif n == "output.weight":
            k = "lm_head.weight"
        else:
            _, i, what, _ = n.split(".")
            k = f"model.layers.{i}.{MAP[what]}.weight"
            if what == "attn_q":
                w = rperm(w, dims["NH"])
            if what == "attn_k":
                w = rperm(w, dims["KV"])
        sd[k] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    dims["tied"] = "lm_head.weight" not in sd
    return dims, sd


def hf_config(d, inter, layers):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d["H"], "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": d["NH"], "num_key_value_heads": d["KV"],
            "head_dim": d["H"] // d["NH"], "hidden_act": "silu", "max_position_embeddings": d["ctx"],
            "rms_norm_eps": d["eps"], "rope_theta": d["theta"], "rope_scaling": None, "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": d["tied"], "vocab_size": d["V"], "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True}


DT = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


def fast_save(tensors, path):
    """safetensors writer without the extra host copy of safetensors.torch.save_file."""
    hdr, off, items = {"__metadata__": {"format": "pt"}}, 0, []
    for k, v in tensors.items():
        v = v.contiguous().cpu()
        n = v.numel() * v.element_size()
        hdr[k] = {"dtype": DT[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + n]}
        off += n
        items.append(v)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for v in items:
            if v.numel():
                f.write(memoryview(v.view(torch.uint8).reshape(-1).numpy()))


def write_sharded(d, gen, shard_bytes=4 << 30):
    os.makedirs(d, exist_ok=True)
    cur, sz, total, idx, wm = {}, 0, 0, 0, {}

    def flush():
        nonlocal cur, sz, idx
        if not cur:
            return
        idx += 1
        fn = f"model-{idx:05d}.safetensors"
        fast_save(cur, os.path.join(d, fn))
        for k in cur:
            wm[k] = fn
        cur, sz = {}, 0

    for k, v in gen:
        v = v.to(torch.bfloat16).contiguous().cpu()
        cur[k] = v
        n = v.numel() * 2
        sz += n
        total += n
        if sz >= shard_bytes:
            flush()
    flush()
    json.dump({"metadata": {"total_size": total}, "weight_map": wm},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    return total // 2


def padded_gen(d, sdb, inter, layers, dev, seed=0):
    """Yield the zero-padded variant's tensors. Extra layers: random q/k/v/gate/up (real work), zero o/down."""
    H, I, L, NH, KV = d["H"], d["I"], d["L"], d["NH"], d["KV"]
    HD = H // NH
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g, device=dev, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)

    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if k in sdb:
            yield k, sdb[k]
    for i in range(layers):
        p = f"model.layers.{i}."
        if i < L:
            for k in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                      "self_attn.v_proj", "self_attn.o_proj"):
                yield p + k + ".weight", sdb[p + k + ".weight"]
            for k in ("gate_proj", "up_proj"):
                w = torch.zeros(inter, H, dtype=torch.bfloat16, device=dev)
                w[:I] = sdb[p + "mlp." + k + ".weight"].to(dev)
                yield p + "mlp." + k + ".weight", w
            w = torch.zeros(H, inter, dtype=torch.bfloat16, device=dev)
            w[:, :I] = sdb[p + "mlp.down_proj.weight"].to(dev)
            yield p + "mlp.down_proj.weight", w
        else:
            yield p + "input_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
            yield p + "post_attention_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
            yield p + "self_attn.q_proj.weight", rnd(NH * HD, H)
            yield p + "self_attn.k_proj.weight", rnd(KV * HD, H)
            yield p + "self_attn.v_proj.weight", rnd(KV * HD, H)
            yield p + "self_attn.o_proj.weight", torch.zeros(H, NH * HD, dtype=torch.bfloat16)
            yield p + "mlp.gate_proj.weight", rnd(inter, H)
            yield p + "mlp.up_proj.weight", rnd(inter, H)
            yield p + "mlp.down_proj.weight", torch.zeros(H, inter, dtype=torch.bfloat16)


def save_tokenizer(gguf_path, out_dirs, chat_template):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
    if not getattr(tok, "chat_template", None) and chat_template:
        tok.chat_template = chat_template
    for d in out_dirs:
        tok.save_pretrained(d)
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False},
                  open(os.path.join(d, "generation_config.json"), "w"))
    return tok


@torch.no_grad()
def greedy_batch(model, prompts_ids, new, dev, pad_id):
    """Left-padded batched greedy decode with HF generate; returns new-token lists (cut at EOS)."""
    n = max(len(p) for p in prompts_ids)
    ids = torch.full((len(prompts_ids), n), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts_ids):
        ids[i, n - len(p):] = torch.tensor(p)
        am[i, n - len(p):] = 1
    out = model.generate(input_ids=ids.to(dev), attention_mask=am.to(dev), max_new_tokens=new, do_sample=False,
                         pad_token_id=pad_id)
    return [o[n:].tolist() for o in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="1b,8b")
    ap.add_argument("--check", type=int, default=20, help="prompts for the greedy-identity check (0: skip)")
    ap.add_argument("--check-tokens", type=int, default=64)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    summ_path = os.path.join(a.out, "models.json")
    summ = json.load(open(summ_path)) if os.path.exists(summ_path) else {}
    d, sd32 = read_gguf(a.gguf)
    chat_template = d.pop("chat_template")
    log("gguf dims", d, "tensors", len(sd32))
    sdb = {k: v.to(torch.bfloat16).contiguous() for k, v in sd32.items()}
    del sd32
    base = os.path.join(a.out, "base")
    os.makedirs(base, exist_ok=True)
    if not os.path.exists(os.path.join(base, "model.safetensors")):
        fast_save(sdb, os.path.join(base, "model.safetensors"))
    json.dump(hf_config(d, d["I"], d["L"]), open(os.path.join(base, "config.json"), "w"), indent=1)
    summ["dims"] = d
    summ["base"] = {"path": base, "params": sum(v.numel() for v in sdb.values()), "intermediate": d["I"], "layers": d["L"]}
    tok = save_tokenizer(a.gguf, [base], chat_template)
    summ["chat_template_in_tokenizer"] = bool(getattr(tok, "chat_template", None))
    json.dump(summ, open(summ_path, "w"), indent=1)
    vnames = [v for v in a.variants.split(",") if v]
    vdirs = []
    for v in vnames:
        inter, layers = VARIANTS[v]
        vd = os.path.join(a.out, v)
        vdirs.append(vd)
        if os.path.exists(os.path.join(vd, "model.safetensors.index.json")) and v in summ:
            log("variant exists", v)
            continue
        t = time.time()
        params = write_sharded(vd, padded_gen(d, sdb, inter, layers, dev))
        json.dump(hf_config(d, inter, layers), open(os.path.join(vd, "config.json"), "w"), indent=1)
        summ[v] = {"path": vd, "params": params, "intermediate": inter, "layers": layers,
                   "extra_layers": layers - d["L"], "build_s": round(time.time() - t, 1)}
        log(f"variant {v}: {params / 1e9:.3f}B params, I={inter}, L={layers}, {time.time() - t:.1f}s")
        for f in os.listdir(base):
            if not f.endswith(".safetensors") and f != "config.json":
                shutil.copy(os.path.join(base, f), vd)
        json.dump(summ, open(summ_path, "w"), indent=1)

    if a.check > 0:
        import transformers
        from transformers import LlamaForCausalLM
        qs = (CHECK_PROMPTS * ((a.check + len(CHECK_PROMPTS) - 1) // len(CHECK_PROMPTS)))[:a.check]
        pids = [chat_ids(tok, q) for q in qs]
        res = {"transformers": transformers.__version__, "device": dev, "dtype": "bfloat16", "prompts": qs,
               "new_tokens": a.check_tokens, "method": "HF generate, greedy, batched (left padding), same batch for all"}
        m = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(dev).eval()
        ref = greedy_batch(m, pids, a.check_tokens, dev, 2)
        res["base_text0"] = tok.decode(ref[0])
        log("base answer 0:", repr(res["base_text0"][:120]))
        # logits on the base's own greedy sequences, to compare the variants' logits too
        full = [p + r for p, r in zip(pids, ref)]
        with torch.no_grad():
            lref = [m(torch.tensor([f], device=dev)).logits.float() for f in full[:4]]
        del m
        res["variants"] = {}
        for v, vd in zip(vnames, vdirs):
            t = time.time()
            mv = LlamaForCausalLM.from_pretrained(vd, dtype=torch.bfloat16).to(dev).eval()
            out = greedy_batch(mv, pids, a.check_tokens, dev, 2)
            with torch.no_grad():
                dl = max((mv(torch.tensor([f], device=dev)).logits.float() - l).abs().max().item()
                         for f, l in zip(full[:4], lref))
            same = [o == r for o, r in zip(out, ref)]
            res["variants"][v] = {"identical": sum(same), "of": len(same), "per_prompt": same,
                                  "max_abs_dlogit_4seq": dl, "params": sum(p.numel() for p in mv.parameters()),
                                  "seconds": round(time.time() - t, 1)}
            log(f"check {v}: identical greedy {sum(same)}/{len(same)}, max|dlogit| {dl:.3g}")
            del mv
            torch.cuda.empty_cache() if dev == "cuda" else None
        summ["greedy_identity_check"] = res
        json.dump(summ, open(summ_path, "w"), indent=1)
    log("MODELS_SUMMARY", json.dumps({k: v for k, v in summ.items() if k != "greedy_identity_check"})[:1500])
    ok = all(r["identical"] == r["of"] for r in summ.get("greedy_identity_check", {}).get("variants", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
