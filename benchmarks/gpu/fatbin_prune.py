"""Keep only some GPU architectures' cubins in a shared library's CUDA fat binaries (HERE, no GPU):

  python3 benchmarks/gpu/fatbin_prune.py IN.so OUT.so --keep-arch 90 [--report]

sglang-kernel 0.4.5's FA3 `flash_ops.abi3.so` (1.12 GB) carries each of its 372 fat binaries as ELF cubins for
sm80, sm86 and sm90 (1,035 MB of its 1,123 MB: 269 + 269 + 497 MB); a Hopper loads the sm90 ones only. Each fat
binary stays where it is (the registration wrapper's pointer and its relocation are untouched); inside it the kept
entries are moved to its front, unchanged byte for byte, the header's size is cut to them, and the freed bytes
become zeros (which compress to nothing). The result is what nvcc writes for an sm90-only build, padded. Refused
(exit 2, nothing written): a fat binary or entry that does not parse, a compressed entry, a PTX entry (a JIT
fallback we would drop), or a fat binary left without any kept cubin.
"""
from __future__ import annotations

import argparse
import collections
import struct
import sys

MAGIC = 0xBA55ED50
HDR = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
ENTRY = struct.Struct("<HHIQ")  # kind (1 PTX, 2 ELF), version, entry header size, padded payload size
ARCH_AT, FLAGS_AT = 28, 40
COMPRESSED = 0x2000


class FatbinError(ValueError):
    pass


def section(data: bytes, name: bytes = b".nv_fatbin") -> tuple[int, int]:
    """(file offset, size) of the ELF64 section `name`."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise FatbinError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def sh(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
    stroff = sh(shstrndx)[4]
    for i in range(shnum):
        s = sh(i)
        end = data.index(b"\0", stroff + s[0])
        if data[stroff + s[0]:end] == name:
            return s[4], s[5]
    raise FatbinError(f"no {name.decode()} section")


def fatbins(data: bytes, off: int, size: int):
    """Each fat binary of the section: (start, header size, entries [(start, length, kind, arch, flags)])."""
    pos, end = off, off + size
    while pos < end:
        if pos + HDR.size > end:
            break
        magic, _ver, hsz, fsz = HDR.unpack_from(data, pos)
        if magic != MAGIC:
            if any(data[pos:pos + 8]):
                raise FatbinError(f"bytes at {pos:#x} are neither a fat binary nor padding")
            pos += 8
            continue
        entries, p, e = [], pos + hsz, pos + hsz + fsz
        if e > end:
            raise FatbinError(f"fat binary at {pos:#x} runs past its section")
        while p < e:
            kind, _v, ehs, psize = ENTRY.unpack_from(data, p)
            if ehs < FLAGS_AT + 8 or p + ehs + psize > e:
                raise FatbinError(f"entry at {p:#x} does not parse")
            arch, = struct.unpack_from("<I", data, p + ARCH_AT)
            flags, = struct.unpack_from("<Q", data, p + FLAGS_AT)
            entries.append((p, ehs + psize, kind, arch, flags))
            p += ehs + psize
        yield pos, hsz, entries
        pos = e


def prune(data: bytes, keep: set[int]) -> tuple[bytearray, dict]:
    off, size = section(data)
    out = bytearray(data)
    report = {"fatbins": 0, "kept": collections.Counter(), "dropped": collections.Counter()}
    for start, hsz, entries in list(fatbins(data, off, size)):
        report["fatbins"] += 1
        for _p, _n, kind, arch, flags in entries:
            if kind != 2:
                raise FatbinError(f"fat binary at {start:#x} holds a PTX entry (sm{arch}): not pruned")
            if flags & COMPRESSED:
                raise FatbinError(f"fat binary at {start:#x} holds a compressed entry (sm{arch})")
        kept = [x for x in entries if x[3] in keep]
        if not kept:
            raise FatbinError(f"fat binary at {start:#x} has no cubin for sm{sorted(keep)}")
        body = b"".join(data[p:p + n] for p, n, *_ in kept)
        total = sum(n for _p, n, *_ in entries)
        first = start + hsz
        out[first:first + total] = body + bytes(total - len(body))
        struct.pack_into("<Q", out, start + 8, len(body))
        for _p, n, _k, arch, _f in entries:
            report["kept" if arch in keep else "dropped"][f"sm{arch}"] += n
    return out, report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--keep-arch", default="90", help="comma list of SM versions whose cubins stay (default 90)")
    a = ap.parse_args(argv)
    keep = {int(x) for x in a.keep_arch.split(",") if x}
    data = open(a.src, "rb").read()
    try:
        out, rep = prune(data, keep)
        # the result must parse to the kept cubins alone, each byte-identical to its source
        off, size = section(bytes(out))
        for (s0, _h0, e0), (s1, _h1, e1) in zip(fatbins(data, off, size), fatbins(bytes(out), off, size)):
            want = [data[p:p + n] for p, n, _k, arch, _f in e0 if arch in keep]
            if s0 != s1 or [bytes(out[p:p + n]) for p, n, *_ in e1] != want:
                raise FatbinError(f"fat binary at {s0:#x}: the pruned entries differ from the source's")
    except FatbinError as e:
        print(f"fatbin_prune: {a.src}: {e}", file=sys.stderr)
        return 2
    with open(a.dst, "wb") as f:
        f.write(out)
    mb = lambda c: {k: round(v / 1e6, 1) for k, v in sorted(c.items())}  # noqa: E731
    print(f"{rep['fatbins']} fat binaries; kept MB {mb(rep['kept'])}; dropped MB {mb(rep['dropped'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
