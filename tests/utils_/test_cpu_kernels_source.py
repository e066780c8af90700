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
