"""The ctypes argument structs (`kernels.cpu._abi`) mirror the C typedefs in kernels/csrc field for field
(names, order, C types), and every exported entry point has a signature: no compiler needed."""
from __future__ import annotations

import ctypes
import re

from kernels.cpu import _abi, _build

_CODE = {ctypes.c_void_p: "P", ctypes.c_long: "L", ctypes.c_float: "F", ctypes.c_double: "D"}
_BASE = {"long": "L", "float": "F", "double": "D"}


def _c_structs() -> dict[str, list[tuple[str, str]]]:
    """{typedef name: [(field, P/L/F/D)]} of every `typedef struct {...} name;` under kernels/csrc."""
    out = {}
    for name, text in _build._sources().items():
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for body, tname in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", text, flags=re.S):
            fields = []
            for decl in filter(None, (d.strip() for d in body.split(";"))):
                base, first = re.match(r"(?:const\s+)?(\w+)\s+(.*)", decl).groups()
                for d in first.split(","):
                    fields.append((d.strip().lstrip("*").strip(), "P" if "*" in d else _BASE[base]))
            out[tname] = fields
    return out


def test_structs_mirror_the_c_typedefs():
    c = _c_structs()
    py = {re.match(r"`(\w+)`", cls.__doc__).group(1): cls for cls in vars(_abi).values()
          if isinstance(cls, type) and issubclass(cls, ctypes.Structure) and cls.__module__ == _abi.__name__}
    assert sorted(py) == sorted(c)
    for tname, cls in py.items():
        assert [(f, _CODE[t]) for f, t in cls._fields_] == c[tname], tname


def test_every_entry_point_has_a_signature():
    exported = set()
    for text in _build._sources().values():
        exported |= set(re.findall(r"^(?:void|long) (moeray_\w+)\(", text, flags=re.M))
    assert exported == set(_abi.SIGNATURES)
