"""dev/sass.py's parsing of an nvdisasm listing (the tool itself needs nvdisasm, from CUDA's
pip wheels; these checks do not)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev"))

import sass  # noqa: E402

LISTING = """
        /*0140*/              @!P2 STS [R34+0xa220], R3 ;
        /*0160*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0170*/              @!P1 LDG.E R32, desc[UR6][R4.64] ;
        /*0180*/                   LDG.E.STRONG.SYS R22, desc[UR6][R60.64] ;
        /*01a0*/                   SHF.R.U32.HI R41, RZ, 0x5, R33 ;
        /*01e0*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_u64) ;
        /*3f00*/                   LDS.128 R12, [R14+0x9ce0] ;
        /*3f10*/                   ATOMS.POPC.INC.32 RZ, [R11+UR16] ;
        /*39c0*/                   @!UP0 UBLKPF.L2 [UR14], UR5 ;
        /*9fa0*/                   VOTE.ANY R84, PT, P0 ;
"""


def test_parse_and_kinds():
    ins = sass.parse(LISTING)
    assert [op for _, _, op, _ in ins][:4] == ["STS", "BAR.SYNC.DEFER_BLOCKING", "LDG.E", "LDG.E.STRONG.SYS"]
    assert ins[2][:2] == (0x170, "@!P1") and ins[2][3].startswith("R32, desc")
    kinds = [sass.kind(op) for _, _, op, _ in ins]
    assert kinds == ["shared store", "barrier", "global load", "global load", "other", "branch / call",
                     "shared load", "shared atomic", "other", "shuffle / vote / redux"]
    # the launch order: the epoch / status loads after the first barrier (the merge's default)
    first = sass.prologue(ins, 4)
    assert "BAR.SYNC" in first[1] and "LDG.E R32" in first[2]


def test_missing_tool_names_the_wheel(monkeypatch):
    monkeypatch.setenv("NVDISASM", "")
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass.sys, "path", [])
    monkeypatch.setattr(sass.sysconfig, "get_paths", lambda: {"purelib": "/nonexistent"})
    try:
        sass.tool("nvdisasm")
    except SystemExit as e:
        assert "pip install nvidia-cuda-nvdisasm" in str(e)
    else:
        raise AssertionError("no error for a missing nvdisasm")


def test_packed_cubins(tmp_path):
    """A folder packed by dev/pack_cubins.sh (cubins gzipped) is read too: the image names and
    an unpacked copy for nvdisasm / cuobjdump."""
    import gzip

    raw = b"\x7fELF fake cubin"
    (tmp_path / "merge.cubin.gz").write_bytes(gzip.compress(raw))
    assert sass.image_name(str(tmp_path / "merge.cubin.gz")) == "merge"
    assert sass.image_name("x/select_push_lean.cubin") == "select_push_lean"
    p = sass.plain(str(tmp_path / "merge.cubin.gz"))
    assert p.endswith(".cubin") and open(p, "rb").read() == raw
    os.unlink(p)
    assert sass.plain("a.cubin") == "a.cubin"
