"""Draft checkpoint helpers (stdlib + torch + safetensors; run anywhere).

The committed draft keeps no lm_head when it was trained with --freeze-head: its lm_head is exactly the
target's (tied) embedding rows of the draft vocabulary, hot = d2t + arange(draft_vocab). That halves the
file (10 MB instead of 20 MB), which matters because every tracked byte travels with each device call.

  python3 draft_io.py strip  FULL.safetensors BASE_MODEL_DIR SLIM.safetensors   (checks the head is the target's)
  python3 draft_io.py restore SLIM.safetensors BASE_MODEL_DIR FULL.safetensors
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file


def _embed(base_dir):
    idx = os.path.join(base_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        fn = json.load(open(idx))["weight_map"]["model.embed_tokens.weight"]
        return load_file(os.path.join(base_dir, fn))["model.embed_tokens.weight"]
    return load_file(os.path.join(base_dir, "model.safetensors"))["model.embed_tokens.weight"]


def head_rows(d2t, embed):
    hot = d2t.to(torch.int64) + torch.arange(d2t.numel())
    return embed[hot].to(torch.bfloat16).contiguous()


def strip(full, base_dir, slim):
    w = load_file(full)
    if not torch.equal(w["lm_head.weight"], head_rows(w["d2t"], _embed(base_dir))):
        raise SystemExit("lm_head is not the target's embedding rows: keep the full checkpoint")
    del w["lm_head.weight"]
    save_file(w, slim, metadata={"format": "pt", "lm_head": "target embed_tokens[d2t + arange]"})


def restore(slim, base_dir, full):
    w = load_file(slim)
    if "lm_head.weight" not in w:
        w["lm_head.weight"] = head_rows(w["d2t"], _embed(base_dir))
    save_file(w, full, metadata={"format": "pt"})


if __name__ == "__main__":
    cmd, a, b, c = sys.argv[1:5]
    (strip if cmd == "strip" else restore)(a, b, c)
    print(cmd, "ok ->", c)
