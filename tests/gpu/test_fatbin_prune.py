"""benchmarks/gpu/fatbin_prune.py: an sm90-only FA3 library for the testbed, from sglang-kernel's sm80/86/90 one.
The fat binaries here are built in the layout the tool reads (the same as flash_ops.abi3.so's, checked there)."""
import os
import struct
import subprocess
import sys

import pytest

GPU = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")
sys.path.insert(0, GPU)
import fatbin_prune as F  # noqa: E402


def entry(arch, payload, kind=2, flags=0):
    hdr = bytearray(64)
    struct.pack_into("<HHIQ", hdr, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", hdr, F.ARCH_AT, arch)
    struct.pack_into("<Q", hdr, F.FLAGS_AT, flags)
    return bytes(hdr) + payload


def fatbin(*entries):
    body = b"".join(entries)
    return F.HDR.pack(F.MAGIC, 1, 16, len(body)) + body


def elf(section_data):
    """A minimal ELF64: the header, .nv_fatbin, .shstrtab, three section headers (null, the two)."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    data_off = 64
    str_off = data_off + len(section_data)
    sh_off = str_off + len(names)
    hdr = bytearray(64)
    hdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", hdr, 0x28, sh_off)
    struct.pack_into("<HHH", hdr, 0x3A, 64, 3, 2)
    shs = bytes(64) + struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, data_off, len(section_data), 0, 0, 8, 0) \
        + struct.pack("<IIQQQQIIQQ", 12, 3, 0, 0, str_off, len(names), 0, 0, 1, 0)
    return bytes(hdr) + section_data + names + shs


def payload(tag, n):
    return (tag * n)[:n]


def test_keeps_each_fat_binarys_sm90_cubins_at_its_front_and_zeroes_the_rest(tmp_path):
    a = [entry(80, payload(b"a80", 40)), entry(86, payload(b"a86", 48)), entry(90, payload(b"a90", 56))]
    b = [entry(90, payload(b"b90", 24)), entry(80, payload(b"b80", 32)), entry(86, payload(b"b86", 16))]
    sec = fatbin(*a) + bytes(16) + fatbin(*b)
    src, dst = tmp_path / "in.so", tmp_path / "out.so"
    src.write_bytes(elf(sec))
    r = subprocess.run([sys.executable, os.path.join(GPU, "fatbin_prune.py"), str(src), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "2 fat binaries" in r.stdout
    out = dst.read_bytes()
    assert len(out) == len(src.read_bytes())
    off, size = F.section(out)
    bins = list(F.fatbins(out, off, size))
    assert [b[0] - off for b in bins] == [0, len(fatbin(*a)) + 16]  # each where it was
    assert [[x[3] for x in e] for _s, _h, e in bins] == [[90], [90]]
    assert out[off + 16:off + 16 + len(a[2])] == a[2]  # byte for byte, at the front
    start_b = off + len(fatbin(*a)) + 16
    assert out[start_b + 16:start_b + 16 + len(b[0])] == b[0]
    assert not any(out[off + 16 + len(a[2]):off + len(fatbin(*a))])  # what sm80/86 held is zeros


@pytest.mark.parametrize("bad, why", [
    (fatbin(entry(80, b"x" * 8), entry(90, b"y" * 8, kind=1)), "PTX"),
    (fatbin(entry(90, b"y" * 8, flags=F.COMPRESSED)), "compressed"),
    (fatbin(entry(80, b"x" * 8), entry(86, b"z" * 8)), "no cubin for sm[90]"),
    (b"\x01" * 8 + fatbin(entry(90, b"y" * 8)), "neither a fat binary nor padding"),
])
def test_refuses_what_it_cannot_prune_safely_and_writes_nothing(tmp_path, bad, why):
    src, dst = tmp_path / "in.so", tmp_path / "out.so"
    src.write_bytes(elf(bad))
    r = subprocess.run([sys.executable, os.path.join(GPU, "fatbin_prune.py"), str(src), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and why in r.stderr and not dst.exists()


def test_refuses_a_file_without_fat_binaries(tmp_path):
    src = tmp_path / "in.so"
    src.write_bytes(b"not an elf at all")
    with pytest.raises(F.FatbinError, match="ELF64"):
        F.section(src.read_bytes())
