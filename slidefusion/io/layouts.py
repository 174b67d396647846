"""Which families have an original (non-diffusers) single-file layout, and the module naming it.

Each layout module provides: FAMILY, LORA_PREFIX, `original_name`, `diffusers_name`, `layout_of`,
`to_original`, `alpha_is_read` (see `wan_layout`).
"""

from __future__ import annotations

from slidefusion.errors import check
from slidefusion.io import wan_layout

LAYOUTS = {wan_layout.FAMILY: wan_layout}  # family -> its layout module


def layout_for(adapter, what: str):
    """The original-layout module of `adapter`'s family, or a UserError (`what` leads it) naming
    the families that have one."""
    check(adapter.family in LAYOUTS, f"{what} has no layout for {adapter.class_name} ({adapter.family}); "
                                     f"supported: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[adapter.family]
