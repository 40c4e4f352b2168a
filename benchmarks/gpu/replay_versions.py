"""Replay recorded GPU telemetry (a run_bench/specctl_e2e archive) through the real ControllerService on the
frames' own clock and list the policy versions it would publish.

  python3 benchmarks/gpu/replay_versions.py ARCHIVE.tar[.xz] MEMBER_SUBSTRING ['{"setting": value}']
The settings are ServiceSettings fields, and "tick_s": how often the service ticks (default 1 s; the
daemon polls every 50 ms, so 0.05 replays it as it runs, prompt refits included).
e.g. benchmarks/gpu/logs/2026-11-30/call6-sweep-online-overhead/g0-telemetry.tar specctl-specctl/telemetry
"""
import gzip, io, json, sys, tarfile
from specctl.controller.service import ControllerService, ServiceSettings

def frames_from(tar, member_sub):
    out = []
    with tarfile.open(tar) as t:
        for m in t.getmembers():
            if m.isfile() and member_sub in m.name and ".jsonl" in m.name:
                gz = gzip.GzipFile(fileobj=io.BytesIO(t.extractfile(m).read()))
                try:
                    for ln in gz:  # a recording cut by a SIGKILL: what was flushed is read
                        out.append(ln.strip())
                except (EOFError, OSError):
                    pass
    out = [b for b in out if b.startswith(b"{") and b.endswith(b"}")]
    out.sort(key=lambda b: json.loads(b)["ts"])
    return out

def run(frames, tick_s=1.0, **kw):
    clock = [json.loads(frames[0])["ts"]]
    svc = ControllerService(ServiceSettings(candidates=None, **kw), clock=lambda: clock[0])
    versions = []; last_t = clock[0]
    for f in frames:
        ts = json.loads(f)["ts"]
        while last_t + tick_s <= ts:
            last_t += tick_s; clock[0] = last_t
            rec = svc.tick()
            if rec is not None and (not versions or versions[-1][1] != rec.version):
                versions.append((round(last_t - json.loads(frames[0])["ts"], 1), rec.version, [(r.min_batch, r.max_batch, r.config.steps) for r in rec.table]))
        clock[0] = ts
        svc.observe_frame(f)
    return versions, svc

if __name__ == "__main__":
    tar, sub = sys.argv[1], sys.argv[2]
    fr = frames_from(tar, sub)
    kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    v, svc = run(fr, **kw)
    tables = sum(1 for a, b in zip(v, v[1:]) if a[2] != b[2]) + (1 if v else 0)
    print(len(fr), "frames;", len(v), "versions,", tables, "with a different table (the rest: exploration rows); span",
          v[-1][0] if v else None, "s")
    for x in v[-3:]: print(x)
