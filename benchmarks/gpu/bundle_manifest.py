"""Manifest of the GPU bundle: every artifact, its parts, their sizes and sha256, and the sha256 of the
joined artifact. Stdlib only (runs here and on the GPU machine).

  python3 bundle_manifest.py write BUNDLE_DIR            -> BUNDLE_DIR/MANIFEST.json
  python3 bundle_manifest.py stash BUNDLE_DIR STASH_DIR  -> copies the parts present into STASH_DIR after
        checking each one's sha256; joins every artifact whose parts are all there, checks the joined
        sha256, prints one JSON line per artifact ({"artifact", "state": complete|partial|missing, ...})
  python3 bundle_manifest.py status STASH_DIR            -> the same report from STASH_DIR alone
  python3 bundle_manifest.py stage BUNDLE_DIR TREE_BYTES [LIMIT_MIB]
        -> re-splits the GGUF and the site so that the fewest calls carry everything but the JIT cache (each
        call: the working tree + its parts <= LIMIT_MIB, default 64, less 0.25 MiB); rewrites MANIFEST.json;
        prints each call's carry list as JSON lines (A, B, C, ...; the last one carries the JIT cache: install
        and measure at once)
  python3 bundle_manifest.py stage BUNDLE_DIR TREE_BYTES LIMIT_MIB EXTRA...   (EXTRA: fa3.so.xz,
        flashinfer-jit-cache-sm90.tgz) -> the same with the extras (FA3 re-split too) and the JIT cache packed
        after deep_gemm: the last call completes everything

An artifact named X is either the single file X or the parts X.part00, X.part01, ... (split -d -a 2).
"""
import hashlib
import json
import os
import re
import shutil
import sys
import time

SCHEMA = "specctl.gpubundle/1"
PART_RE = re.compile(r"^(?P<base>.+)\.part(?P<idx>\d{2,})$")
SKIP_DIRS = {"wheels", "cache"}
SKIP_FILES = {"MANIFEST.json"}


def sha256_of(paths, bufsize=1 << 20):
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while True:
                b = f.read(bufsize)
                if not b:
                    break
                h.update(b)
    return h.hexdigest()


def group_files(names):
    """{artifact: [part file names in order]} from a list of file names."""
    groups = {}
    for n in sorted(names):
        m = PART_RE.match(n)
        if m:
            groups.setdefault(m.group("base"), []).append((int(m.group("idx")), n))
        else:
            groups.setdefault(n, []).append((-1, n))
    out = {}
    for base, items in groups.items():
        items.sort()
        if len(items) > 1 and any(i < 0 for i, _ in items):
            raise ValueError(f"{base}: both a whole file and parts")
        idx = [i for i, _ in items]
        if idx[0] >= 0 and idx != list(range(len(idx))):
            raise ValueError(f"{base}: parts not numbered 00..{len(idx)-1:02d}: {idx}")
        out[base] = [n for _, n in items]
    return out


def build_manifest(bundle_dir):
    names = [n for n in os.listdir(bundle_dir)
             if os.path.isfile(os.path.join(bundle_dir, n)) and n not in SKIP_FILES and not n.startswith(".")]
    arts = {}
    for base, parts in group_files(names).items():
        paths = [os.path.join(bundle_dir, p) for p in parts]
        arts[base] = {
            "parts": [{"name": p, "bytes": os.path.getsize(q), "sha256": sha256_of([q])} for p, q in zip(parts, paths)],
            "bytes": sum(os.path.getsize(q) for q in paths),
            "sha256": sha256_of(paths),
        }
    return {"schema": SCHEMA, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "artifacts": arts}


def load_manifest(path):
    m = json.load(open(path))
    if m.get("schema") != SCHEMA:
        raise ValueError(f"unknown manifest schema {m.get('schema')!r}")
    return m


def stash(bundle_dir, stash_dir, manifest=None):
    """Copy verified parts from bundle_dir into stash_dir; join complete artifacts. Returns report rows."""
    os.makedirs(stash_dir, exist_ok=True)
    if manifest is None:
        src = os.path.join(bundle_dir, "MANIFEST.json") if bundle_dir else None
        if src and os.path.exists(src):
            shutil.copy(src, os.path.join(stash_dir, "MANIFEST.json"))
        manifest = load_manifest(os.path.join(stash_dir, "MANIFEST.json"))
    rows = []
    for art, info in sorted(manifest["artifacts"].items()):
        joined = os.path.join(stash_dir, art)
        if os.path.exists(joined) and os.path.exists(joined + ".ok"):
            rows.append({"artifact": art, "state": "complete", "path": joined, "bytes": info["bytes"]})
            continue
        have, bad = [], []
        for p in info["parts"]:
            dst = os.path.join(stash_dir, p["name"])
            if not os.path.exists(dst) and bundle_dir and os.path.exists(os.path.join(bundle_dir, p["name"])):
                src = os.path.join(bundle_dir, p["name"])
                if os.path.getsize(src) != p["bytes"] or sha256_of([src]) != p["sha256"]:
                    bad.append(p["name"])
                    continue
                shutil.copy(src, dst + ".tmp")
                os.replace(dst + ".tmp", dst)
            if os.path.exists(dst):
                have.append(p["name"])
        row = {"artifact": art, "have": len(have), "of": len(info["parts"])}
        if bad:
            row["bad_parts"] = bad
        if len(have) == len(info["parts"]):
            paths = [os.path.join(stash_dir, p["name"]) for p in info["parts"]]
            if len(paths) == 1 and paths[0] == joined:
                ok = sha256_of([joined]) == info["sha256"]
            else:
                with open(joined + ".tmp", "wb") as out:
                    for q in paths:
                        with open(q, "rb") as f:
                            shutil.copyfileobj(f, out, 1 << 22)
                ok = sha256_of([joined + ".tmp"]) == info["sha256"]
                if ok:
                    os.replace(joined + ".tmp", joined)
                    for q in paths:
                        os.remove(q)
            if ok:
                open(joined + ".ok", "w").write(info["sha256"] + "\n")
                row.update(state="complete", path=joined, bytes=info["bytes"])
            else:
                row.update(state="corrupt")
        else:
            row["state"] = "partial" if have else "missing"
        rows.append(row)
    return rows


def _resplit(bundle_dir, base, sizes):
    """Join base's parts and split them again into parts of `sizes` bytes (the last takes the rest)."""
    parts = group_files(os.listdir(bundle_dir)).get(base) or []
    joined = os.path.join(bundle_dir, base + ".joined")
    with open(joined, "wb") as out:
        for p in parts:
            with open(os.path.join(bundle_dir, p), "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    for p in parts:
        os.remove(os.path.join(bundle_dir, p))
    names = []
    with open(joined, "rb") as f:
        for k, n in enumerate(list(sizes) + [None]):
            data = f.read() if n is None else f.read(n)
            if not data and n is None:
                break
            name = f"{base}.part{k:02d}"
            with open(os.path.join(bundle_dir, name), "wb") as o:
                o.write(data)
            names.append(name)
    os.remove(joined)
    return names


SPLITTABLE = ("gguf", "site.txz", "fa3.so.xz")  # the artifacts stage may re-split at a call's boundary


def stage(bundle_dir, tree_bytes, limit_mib=64.0, margin_mib=0.25, max_calls=6, extras=()):
    """The staging calls (A, B, C, ... as many as the limit needs) carry aux, the GGUF, the site and deep_gemm
    in that order, the GGUF and the site re-split at each call's boundary; the measuring call after them
    carries the JIT cache (a few MiB: it restores in seconds). With extras (artifact names in bundle_dir:
    fa3.so.xz, re-split like the GGUF; flashinfer-jit-cache-sm90.tgz) they and the JIT cache are packed after
    deep_gemm into as few calls as the limit allows (install_bundle.sh installs FA3 once the site is in,
    whichever call completes either). Returns {call: carry list (names inside bundle_dir)}."""
    cap = int((limit_mib - margin_mib) * 2**20) - tree_bytes - 4096  # 4 KiB: the MANIFEST every call carries
    groups = group_files(os.listdir(bundle_dir))
    size = lambda n: os.path.getsize(os.path.join(bundle_dir, n))  # noqa: E731
    total = lambda base: sum(size(p) for p in groups.get(base, []))  # noqa: E731
    for x in extras:
        if x not in groups:
            raise ValueError(f"{x}: not in {bundle_dir} (build_bundle.sh builds it; WITH_FA3=1 for fa3.so.xz)")
    items = [("aux.tgz", size("aux.tgz"), False), ("gguf", total("gguf"), True),
             ("site.txz", total("site.txz"), True), ("deepgemm.tgz", size("deepgemm.tgz"), False)]
    if extras:
        items += [(x, total(x), x in SPLITTABLE) for x in extras]
        items += [("jitcache.tgz", size("jitcache.tgz"), False)] if "jitcache.tgz" in groups else []
        max_calls += len(extras) * 3
    need = sum(n for _, n, _ in items)
    if cap <= 0 or need > max_calls * cap:
        raise ValueError(f"{need / 2**20:.1f} MiB do not fit {max_calls} calls of {max(cap, 0) / 2**20:.1f} MiB")
    calls, cuts, room = [[]], {}, cap  # cuts: artifact -> its part sizes but the last
    for name, n, splittable in items:
        while n > 0:
            if n <= room:
                calls[-1].append(name)
                room -= n
                n = 0
            elif splittable and room > 0:
                calls[-1].append(name)
                cuts.setdefault(name, []).append(room)
                n -= room
                room = 0
            if n > 0:
                if len(calls) == max_calls or not calls[-1]:
                    raise ValueError(f"the parts do not fall into {max_calls} calls of {cap / 2**20:.1f} MiB")
                calls.append([])
                room = cap
    parts = {base: _resplit(bundle_dir, base, cuts.get(base, [])) for base, _, split in items if split}
    json.dump(build_manifest(bundle_dir), open(os.path.join(bundle_dir, "MANIFEST.json"), "w"), indent=1)
    out, used = {}, {base: 0 for base in parts}
    for k, names in enumerate(calls):
        carry = []
        for name in names:
            if name in parts:
                carry.append(parts[name][used[name]])
                used[name] += 1
            else:
                carry.append(name)
        out[chr(ord("A") + k)] = carry + ["MANIFEST.json"]
    if not extras:
        out[chr(ord("A") + len(calls))] = ["jitcache.tgz", "MANIFEST.json"]
    return out


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    cmd = argv[1]
    if cmd == "write":
        m = build_manifest(argv[2])
        json.dump(m, open(os.path.join(argv[2], "MANIFEST.json"), "w"), indent=1)
        for a, i in m["artifacts"].items():
            print(f"{a}: {len(i['parts'])} part(s), {i['bytes']/2**20:.1f} MiB, sha256 {i['sha256'][:16]}")
        return 0
    if cmd in ("stash", "status"):
        rows = stash(argv[2], argv[3]) if cmd == "stash" else stash(None, argv[2])
        for r in rows:
            print(json.dumps(r))
        return 1 if any(r["state"] == "corrupt" or r.get("bad_parts") for r in rows) else 0
    if cmd == "stage":
        calls = stage(argv[2], int(argv[3]), float(argv[4]) if len(argv) > 4 else 64.0, extras=argv[5:])
        for k, names in calls.items():
            mib = sum(os.path.getsize(os.path.join(argv[2], n)) for n in names) / 2**20
            print(json.dumps({"call": k, "carry": [f"benchmarks/gpu/bundle/{n}" for n in names], "mib": round(mib, 2)}))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
