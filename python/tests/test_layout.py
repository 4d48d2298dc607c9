"""The ctypes structures match the C compiler's layout of client/include/kvclient.h."""

import ctypes
import os
import shutil
import subprocess

import pytest

from kvclient import _lib, views

from conftest import REPO

STRUCTS = {"kvc_block": _lib.KvcBlock, "kv_hash128": _lib.KvHash128,
           "kv_layout": _lib.KvLayout, "kvc_options": _lib.KvcOptions,
           "kvc_commit_entry": _lib.KvcCommitEntry, "kvc_tier_hits": _lib.KvcTierHits,
           "kvc_fetch_result": _lib.KvcFetchResult}


def test_sizes_are_the_verified_ones():
    for name, cls in STRUCTS.items():
        assert ctypes.sizeof(cls) == _lib.EXPECTED_SIZES[name], name


def test_dlpack_structs_have_the_dlpack_abi():
    # dlpack.h (DLPack 0.8, the unversioned ABI): DLTensor 48 bytes, DLManagedTensor 64.
    assert ctypes.sizeof(views.DLDevice) == 8
    assert ctypes.sizeof(views.DLDataType) == 4
    assert ctypes.sizeof(views.DLTensor) == 48
    assert views.DLTensor.byte_offset.offset == 40
    assert views.DLTensor.shape.offset == 24
    assert ctypes.sizeof(views.DLManagedTensor) == 64
    assert views.DLManagedTensor.deleter.offset == 56


def _c_program():
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvclient.h"',
             "int main(void) {"]
    for name, cls in STRUCTS.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (name, field, name,
                                                                         field))
    lines += ['printf("KVC_NO_PARENT %u\\n", (unsigned)KVC_NO_PARENT);',
              'printf("KV_ERR_COUNT %d\\n", KV_ERR_COUNT);', "return 0; }"]
    return "\n".join(lines)


def test_layout_against_the_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    header = os.path.join(REPO, "client", "include", "kvclient.h")
    if cc is None or not os.path.exists(header):
        pytest.skip("no C compiler or no kvclient.h here")
    src = tmp_path / "layout.c"
    src.write_text(_c_program())
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", os.path.join(REPO, "client", "include"), "-I", REPO, str(src),
                    "-o", str(exe)], check=True, capture_output=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], check=True, capture_output=True).stdout.decode()
               .splitlines())
    for name, cls in STRUCTS.items():
        assert int(got[name]) == ctypes.sizeof(cls), name
        for field, _ in cls._fields_:
            assert int(got["%s.%s" % (name, field)]) == getattr(cls, field).offset, (name,
                                                                                       field)
    assert int(got["KVC_NO_PARENT"]) == _lib.NO_PARENT
    assert int(got["KV_ERR_COUNT"]) == 24


def test_every_header_function_is_declared():
    header = os.path.join(REPO, "client", "include", "kvclient.h")
    if not os.path.exists(header):
        pytest.skip("no kvclient.h here")
    import re
    text = open(header).read()
    declared = set(re.findall(r"KVC_EXTERN[^;(]*?\b(kvc_\w+)\s*\(", text))
    assert declared, "no declarations found"
    assert declared == set(_lib._PROTOS), (declared ^ set(_lib._PROTOS))
