"""`source_with_headers`: the one-file source a C++ library is built from."""
from vllm.utils.cpu_kernels import source_with_headers


def test_headers_are_pasted_in_place_of_their_includes(tmp_path):
    (tmp_path / "a.h").write_text("int a = 1;")
    (tmp_path / "b.h").write_text("int b = 2;")
    main = tmp_path / "main.cpp"
    main.write_text('#include <vector>\n#include "a.h"\nint x;\n#include "b.h"\n')
    text = source_with_headers(str(main), str(tmp_path / "a.h"), str(tmp_path / "b.h"))
    assert text == "#include <vector>\nint a = 1;\nint x;\nint b = 2;\n"
    assert source_with_headers(str(main)) == main.read_text()  # no headers: unchanged


def test_every_build_pastes_the_shared_isa_level():
    """Each kernel library's `isa()` op comes from one definition, vllm/utils/csrc/
    cpu_isa_level.h, pasted by every build in place of the source's include (which libraries
    report which level at each ISA level: tests/utils_/test_cpu_isa.py)."""
    import glob
    import os

    import vllm
    from vllm.utils.cpu_kernels import SHARED_HEADERS, paste_headers

    [header] = [h for h in SHARED_HEADERS if h.endswith("cpu_isa_level.h")]
    text = paste_headers('#include <string>\n#include "cpu_isa_level.h"\n', SHARED_HEADERS)
    assert "std::string isa_level()" in text and '\n#include "cpu_isa_level.h"' not in text
    root = os.path.dirname(vllm.__file__)
    sources = [p for p in glob.glob(os.path.join(root, "**", "*.cpp"), recursive=True)
               if '"isa() -> str"' in open(p).read()]
    assert len(sources) >= 3  # the linear, attention and sampling libraries
    for path in sources:
        source = open(path).read()
        assert '#include "cpu_isa_level.h"' in source, path
        assert "std::string isa_level()" not in source, path  # no copy of its own
    assert "avx512_bf16" in open(header).read()
