"""Variant -> CUDA C++ source, rendered from the Jinja2 templates in ``templates/``.

Jinja only sets constants, includes the shared partials (``templates/common/``) and inserts the
kernel's parameter struct (``kernels.params``); fwd/fwd_wgmma.cu.j2 and bwd/dkdv_wgmma.cu.j2 also
replace named blocks of the templates they extend (the products). All logic is plain CUDA C++.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from .kernels import KernelVariant


def templates_dir() -> Path:
    """The installed copy (``cuflash/templates``) or the source tree's top-level ``templates/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "templates", here.parent / "templates"):
        if (cand / "fwd" / "fwd.cu.j2").is_file():
            return cand
    raise FileNotFoundError(f"cuflash templates not found next to {here}")


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


@functools.lru_cache(maxsize=None)
def render(variant: KernelVariant) -> str:
    """CUDA C++ source of one variant."""
    params = variant.params
    return _environment().get_template(variant.template).render(
        name=variant.name, params_name=params.struct_name, params_struct=params.cuda(),
        params_unpack=params.unpack(), **variant.constants())
