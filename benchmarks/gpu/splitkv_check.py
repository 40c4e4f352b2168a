"""THERE (the GPU): SGLang's split-KV verify kernel against its extend kernel and an fp32 reference, on topk-1
chains, before the splitkv patch can default to on (issue "cheaper speculative steps", item 1).

  PYTHONPATH=/tmp/site python3 benchmarks/gpu/splitkv_check.py OUT.json [--heads 9,3,64] [--quick]

For every batch size (1, 16, 64), mean prefix length (128 .. 16384) and query tokens per request (1, 2, 4, 6 = a
chain of 0, 1, 3, 5 steps): random bf16 q/k/v and KV pool (fresh per case, never zeros), the causal chain mask
SGLang's trivial/chain verify builds, both kernels, and the exact attention in fp32 on the same inputs. Per case:
max |error| and relative L2 error of each kernel against fp32, whether split-KV ran (its can_handle), and
CUDA-graph timings (us). Passes when split-KV's error is no worse than the extend kernel's (x1.5 + 1e-3 slack
for bf16 rounding order) on every case it ran.
"""
import argparse
import json
import time


def reference(q, kb, vb, ke, ve, idx, seq, L, hq, hkv, sm):
    """fp32 causal attention of one request: prefix from the pool (idx) then its own L chain tokens."""
    import torch
    K = torch.cat([kb[idx], ke]).float().repeat_interleave(hq // hkv, 1)
    V = torch.cat([vb[idx], ve]).float().repeat_interleave(hq // hkv, 1)
    sc = torch.einsum("lhd,nhd->hln", q.float(), K) * sm
    mask = torch.ones(L, seq + L, dtype=torch.bool, device=q.device)
    mask[:, seq:] = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
    sc = sc.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hln,nhd->lhd", sc.softmax(-1), V), mask.flatten()


def case(bs, prefix, L, hq, hkv, d, gen):
    import torch
    from sglang.kernels.ops.attention import verify_splitkv as vs
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from triton.testing import do_bench_cudagraph
    dev, sm = "cuda", d ** -0.5
    lo = max(1, prefix - prefix // 8)
    seq = torch.randint(lo, prefix + prefix // 8 + 1, (bs,), generator=gen).to(dev, torch.int32)
    pool = int(seq.sum()) + 1024
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    kb, vb = rnd(pool, hkv, d), rnd(pool, hkv, d)
    kv_indptr = torch.zeros(bs + 1, device=dev, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(seq, 0)
    kv_idx = (torch.randperm(pool - 1, device=dev)[: int(seq.sum())] + 1).to(torch.int64)
    qo = torch.arange(0, (bs + 1) * L, L, device=dev, dtype=torch.int32)
    q, ke, ve = rnd(bs * L, hq, d), rnd(bs * L, hkv, d), rnd(bs * L, hkv, d)
    refs, masks = [], []
    for b in range(bs):
        idx = kv_idx[int(kv_indptr[b]): int(kv_indptr[b + 1])]
        r, m = reference(q[b * L:(b + 1) * L], kb, vb, ke[b * L:(b + 1) * L], ve[b * L:(b + 1) * L], idx,
                         int(seq[b]), L, hq, hkv, sm)
        refs.append(r)
        masks.append(m)
    ref, cmask = torch.cat(refs), torch.cat(masks)
    mind = torch.zeros(bs + 1, device=dev, dtype=torch.int64)
    mind[1:] = torch.cumsum(L * (seq.to(torch.int64) + L), 0)
    o_ext, o_sk = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))  # poisoned: every element written?
    f_ext = lambda: extend_attention_fwd(q, ke, ve, o_ext, kb, vb, qo, kv_indptr, kv_idx, cmask, True, mind, L,  # noqa: E731
                                         1.0, 1.0, sm)
    f_sk = lambda: vs.verify_splitkv_fwd(q, ke, ve, o_sk, kb, vb, qo, kv_indptr, kv_idx, cmask, True, mind, L,  # noqa: E731
                                         1.0, 1.0, sm, max_bs=64)
    f_ext()
    ran = bool(f_sk())
    torch.cuda.synchronize()

    def err(o):
        e = o.float() - ref
        return {"max_abs": e.abs().max().item(), "rel_l2": (e.norm() / ref.norm()).item(),
                "nan": bool(torch.isnan(o).any().item())}

    r = {"bs": bs, "prefix": prefix, "q_tokens": L, "splitkv_ran": ran, "extend": err(o_ext)}
    if ran:
        r["splitkv"] = err(o_sk)
        r["us_extend"] = round(1000 * do_bench_cudagraph(f_ext, rep=20), 2)
        r["us_splitkv"] = round(1000 * do_bench_cudagraph(f_sk, rep=20), 2)
        r["ok"] = (not r["splitkv"]["nan"]) and r["splitkv"]["max_abs"] <= 1.5 * r["extend"]["max_abs"] + 1e-3
    return r


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--heads", default="9,3,64", help="q heads, kv heads, head dim (the testbed's 8b shape)")
    ap.add_argument("--quick", action="store_true", help="prefixes 128 and 2048 only")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    gen = torch.Generator().manual_seed(0)
    prefixes = (128, 2048) if a.quick else (128, 2048, 8192, 16384)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": [hq, hkv, d], "cases": []}
    t0 = time.time()
    for bs in (1, 16, 64):
        for prefix in prefixes:
            for L in (1, 2, 4, 6):
                r = case(bs, prefix, L, hq, hkv, d, gen)
                res["cases"].append(r)
                print(json.dumps(r), flush=True)
    ran = [c for c in res["cases"] if c["splitkv_ran"]]
    res.update(elapsed_s=round(time.time() - t0, 1), ran=len(ran), of=len(res["cases"]),
               ok=bool(ran) and all(c["ok"] for c in ran))
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"split-KV ran on {len(ran)}/{len(res['cases'])} cases; error no worse than extend's: {res['ok']}")


if __name__ == "__main__":
    main()
