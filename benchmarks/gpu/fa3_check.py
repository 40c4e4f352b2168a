"""THERE, after install_bundle.sh put fa3.so.xz (sglang-kernel's flash_ops, sm90 cubins only) into the site:
    PYTHONPATH=/tmp/site python3 benchmarks/gpu/fa3_check.py OUT.json
FA3 through SGLang's own entry point (sgl_kernel.flash_attn.flash_attn_with_kvcache, as its fa3 backend calls it)
against torch's attention on the testbed's shape (head dim 64, 9 query / 3 KV heads, bf16): a paged decode (one
query per request, causal) and a 4-token verify over a paged cache. Exit 0 when both agree (max abs error < 2e-2)."""
import json
import sys
import time
import traceback


def reference(q, k, v, lens, causal_tail):
    """Per request: softmax(q k^T / sqrt(d)) v over its first lens[i] keys, the last causal_tail queries causal."""
    import torch

    outs = []
    for i, n in enumerate(lens):
        qi, ki, vi = q[i].float(), k[i, :n].float(), v[i, :n].float()  # [t, h, d], [n, hk, d]
        rep = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(rep, 1), vi.repeat_interleave(rep, 1)
        s = torch.einsum("thd,nhd->htn", qi, ki) / qi.shape[-1] ** 0.5
        t = qi.shape[0]
        mask = torch.arange(n, device=q.device)[None, :] > (n - t + torch.arange(t, device=q.device))[:, None]
        s = s.masked_fill(mask[None], float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", s.softmax(-1), vi))
    return torch.stack(outs)


def case(fa, torch, bs, t, page, heads=9, kv_heads=3, d=64, max_len=300):
    g = torch.Generator(device="cuda").manual_seed(bs * 7 + t)
    lens = [int(x) for x in torch.randint(t + 1, max_len, (bs,), generator=g, device="cuda")]
    pages_per = (max_len + page - 1) // page
    n_pages = bs * pages_per + 1
    k_cache = torch.randn(n_pages, page, kv_heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(n_pages, page, kv_heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(n_pages - 1, generator=g, device="cuda")[:bs * pages_per] + 1
    page_table = perm.view(bs, pages_per).to(torch.int32)
    q = torch.randn(bs, t, heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                     device="cuda"), page_table=page_table, causal=True)
    k = k_cache[page_table.long()].flatten(1, 2)  # [bs, pages_per * page, hk, d] in each request's order
    v = v_cache[page_table.long()].flatten(1, 2)
    ref = reference(q, k, v, lens, t)
    return float((out.float() - ref).abs().max())


def main(path):
    res = {"ok": False}
    t0 = time.time()
    try:
        import torch
        import sgl_kernel.flash_attn as fa

        res["fa3_supported"] = bool(fa.is_fa3_supported())
        res["decode_max_abs_err"] = case(fa, torch, bs=8, t=1, page=1)
        res["verify4_max_abs_err"] = case(fa, torch, bs=8, t=4, page=1)
        res["decode_page16_max_abs_err"] = case(fa, torch, bs=4, t=1, page=16)
        res["ok"] = res["fa3_supported"] and max(res[k] for k in res if k.endswith("_err")) < 2e-2
    except Exception:
        res["error"] = traceback.format_exc()[-3000:]
    res["s"] = round(time.time() - t0, 1)
    json.dump(res, open(path, "w"), indent=1)
    print("FA3_CHECK", json.dumps({k: v for k, v in res.items() if k != "error"}), res.get("error", ""))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
