"""Plots of a GPU results file (runs HERE; matplotlib from the `plot` extra).

  python3 benchmarks/gpu/plot_results.py benchmarks/results/gpu-DATE-VARIANT.json [--telemetry DIR_OR_TAR] [--out PREFIX]
-> PREFIX.png           output tokens/s vs concurrency per policy, with the envelope of off/static:s1..s3
   PREFIX-decisions.png (with --telemetry: a specctl run's recorded step frames, the daemon's --record)
                        batch size over time, coloured by the steps the plugin ran
"""
import argparse
import gzip
import io
import json
import os
import tarfile

STATICS = ("off", "static:s1", "static:s2", "static:s3")


def load_frames(src):
    """Step frames from a telemetry directory or a .tar.xz/.tgz holding one (…/telemetry/*.jsonl.gz)."""
    blobs = []
    if os.path.isdir(src):
        for root, _, files in os.walk(src):
            blobs += [open(os.path.join(root, f), "rb").read() for f in files if ".jsonl" in f]
    else:
        with tarfile.open(src) as t:
            for m in t.getmembers():
                if m.isfile() and "/telemetry/" in m.name and ".jsonl" in m.name and "specctl-specctl" in m.name:
                    blobs.append(t.extractfile(m).read())
    frames = []
    for b in blobs:
        try:
            text = gzip.decompress(b).decode()
        except (OSError, EOFError):
            text = b.decode(errors="replace")
        for ln in io.StringIO(text):
            try:
                x = json.loads(ln)
            except ValueError:
                continue
            if x.get("kind") == "step":
                frames.append(x)
    frames.sort(key=lambda x: x["ts"])
    return frames


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--telemetry", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.load(open(a.results))
    prefix = a.out or a.results[:-5]
    t = {}
    for x in r["runs"]:
        t.setdefault(x["policy"], {})[x["concurrency"]] = x["output_tokens_per_s"]
    levels = sorted({c for d in t.values() for c in d})
    env = [max(t[p].get(c, 0) for p in STATICS if p in t) for c in levels]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.fill_between(levels, 0, env, color="0.9", label="envelope of off / static:s1..s3")
    for p, d in sorted(t.items()):
        cs = sorted(d)
        style = "-" if p == "specctl" else ("--" if p in STATICS else ":")
        ax.plot(cs, [d[c] for c in cs], style, marker="o", ms=3, lw=2.2 if p == "specctl" else 1.2, label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{r['model']} + EAGLE-3, SGLang {r['sglang']}, {r['gpu']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)
    print("wrote", prefix + ".png")
    if a.telemetry:
        fr = load_frames(a.telemetry)
        if not fr:
            raise SystemExit(f"no step frames in {a.telemetry}")
        t0 = fr[0]["ts"]
        fig, ax = plt.subplots(figsize=(10, 4))
        for s, col in ((0, "tab:gray"), (1, "tab:blue"), (2, "tab:orange"), (3, "tab:green")):
            xs = [(x["ts"] - t0, x["batch_size"]) for x in fr if x["config"]["steps"] == s]
            if xs:
                ax.scatter([p[0] for p in xs], [p[1] for p in xs], s=2, color=col, label=f"steps={s} ({len(xs)})")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("seconds since the first decode step")
        ax.set_ylabel("batch size")
        ax.set_title("specctl on the GPU: every decode step, coloured by the configuration it ran")
        ax.legend(markerscale=4, fontsize=7)
        fig.tight_layout()
        fig.savefig(prefix + "-decisions.png", dpi=110)
        print("wrote", prefix + "-decisions.png", len(fr), "frames")


if __name__ == "__main__":
    main()
