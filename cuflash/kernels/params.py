"""Kernel parameter structs, defined once per kernel as a table of (name, C type).

The table generates both sides of the ABI: the CUDA struct the kernel receives as its one
``const __grid_constant__`` parameter (with a static_assert on its size), and the
``struct.Struct`` that packs the values on the host. Packing follows the table's
types, not the values' Python types, so an int32 field can never be sent as 64 bits: a value out
of the field's range raises instead.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

# C type -> struct format code (native alignment, as the CUDA struct is laid out on x86-64/aarch64).
# CUtensorMap is the driver's opaque 128-byte TMA descriptor (cuTensorMapEncodeTiled). cuda.h
# (CUDA 13) declares it alignas(128) (the driver API asks for at least 64); the struct module
# gives "128s" no alignment, so layout() pads before it.
_FORMATS = {"int": "i", "long long": "q", "float": "f", "CUtensorMap": "128s"}
_ALIGN = {"CUtensorMap": 128}  # C alignments the struct module does not apply itself
TENSOR_MAP_BYTES = 128


def _format(ctype: str) -> str:
    return "Q" if ctype.endswith("*") else _FORMATS[ctype]


@dataclass(frozen=True)
class ParamTable:
    """One kernel's parameters: ``fields`` is a tuple of (name, C type); pointer types may carry
    ``const`` and are declared ``__restrict__`` in the kernel."""
    struct_name: str
    fields: tuple[tuple[str, str], ...]

    def __post_init__(self):
        names = [n for n, _ in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.struct_name}: duplicate field names")
        for _, ctype in self.fields:
            _format(ctype)  # an unknown C type fails here, at import

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.fields)

    @functools.cached_property
    def _checks(self) -> tuple[frozenset, tuple[str, ...]]:
        """The set of names, and the CUtensorMap fields (values() checks their size)."""
        return frozenset(self.names), tuple(n for n, ctype in self.fields if ctype == "CUtensorMap")

    @functools.cached_property
    def _walk(self) -> tuple[str, tuple[int, ...]]:
        """The struct format and each field's byte offset. "0q" pads the end to 8 bytes, as C
        pads a struct holding 8-byte members. A member of an _ALIGN type gets explicit "x"
        padding up to its alignment, and the size is then rounded up to the largest such
        alignment (C's rules, done by hand where the struct module does not apply them)."""
        fmt, align, offsets = "@", 8, []
        for _, ctype in self.fields:
            a = _ALIGN.get(ctype)
            if a:
                fmt += "x" * (-struct.calcsize(fmt) % a)
                align = max(align, a)
            fmt += _format(ctype)
            offsets.append(struct.calcsize(fmt) - struct.calcsize("@" + _format(ctype)))
        fmt += "0q"
        return fmt + "x" * (-struct.calcsize(fmt) % align), tuple(offsets)

    @property
    def layout(self) -> struct.Struct:
        return struct.Struct(self._walk[0])

    def offset(self, name: str) -> int:
        """Byte offset of field ``name`` in the packed struct."""
        return self._walk[1][self.index(name)]

    def values(self, **kw) -> tuple:
        """The values in field order; every field must be given, and nothing else."""
        names, maps = self._checks
        if kw.keys() != names:
            missing = [n for n in self.names if n not in kw]
            raise TypeError(f"{self.struct_name}: missing {missing}, unknown {[n for n in kw if n not in names]}")
        for name in maps:  # "128s" would silently pad or cut a wrong-sized map
            if not (isinstance(kw[name], bytes) and len(kw[name]) == TENSOR_MAP_BYTES):
                raise TypeError(f"{self.struct_name}.{name}: a CUtensorMap is {TENSOR_MAP_BYTES} bytes")
        return tuple(kw[n] for n in self.names)

    @functools.cached_property
    def _positions(self) -> dict:
        return {n: i for i, n in enumerate(self.names)}

    def index(self, name: str) -> int:
        return self._positions[name]

    def cuda(self) -> str:
        """The CUDA struct and its size check (both sides lay the fields out by C's rules, in the
        table's order, so equal sizes mean equal field widths and paddings). There is no
        per-field offset check: the NVRTC of CUDA 13.0 has no __builtin_offsetof."""
        lines = [f"struct {self.struct_name} {{"]
        lines += [f"  {ctype} {name};" for name, ctype in self.fields]
        lines.append("};")
        lines.append(f"static_assert(sizeof({self.struct_name}) == {self.layout.size}, "
                     f"\"{self.struct_name}: host and device layouts differ\");")
        return "\n".join(lines)

    def unpack(self, var: str = "p") -> str:
        """Declarations of the fields as locals (pointers ``__restrict__``)."""
        out = []
        for name, ctype in self.fields:
            if ctype == "CUtensorMap":  # a reference: the TMA reads the map where the launch put it
                out.append(f"  const CUtensorMap& {name} = {var}.{name};")
                continue
            decl = f"{ctype} __restrict__" if ctype.endswith("*") else ctype
            out.append(f"  {decl} {name} = {var}.{name};")
        return "\n".join(out)


def strides(prefix: str, *dims: str) -> tuple[tuple[str, str], ...]:
    """64-bit element strides ``<prefix>_<dim>`` of one operand."""
    return tuple((f"{prefix}_{d}", "long long") for d in dims)


def stride_values(prefix: str, st) -> dict:
    """Batch, sequence and head strides ``st`` as the values of ``strides(prefix, "sb", "ss", "sh")``."""
    return {f"{prefix}_sb": st[0], f"{prefix}_ss": st[1], f"{prefix}_sh": st[2]}
