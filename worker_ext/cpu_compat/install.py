"""Apply the torchvision import guard (CPU hosts only; idempotent).

PyPI's torchvision 0.28.0 is a CUDA build whose ``_C`` extension cannot load against CPU torch; importing it then
crashes at two unguarded ``register_fake`` decorators. SGLang imports torchvision unconditionally, although no
torchvision op runs at serve time. We guard those two decorators with ``extension._has_ops()``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARK = "# flying-serving: guarded (torchvision _C not loadable on this CPU host)"
TARGETS = (
    '@torch.library.register_fake("torchvision::nms")',
    '@torch.library.register_fake("torchvision::qnms")',
)


def guard_source(src: str) -> str:
    """Return ``src`` with each target decorator made conditional on torchvision's ops being loadable."""
    if MARK in src:
        return src
    for target in TARGETS:
        guarded = target.replace("@torch.library.register_fake(", "@_flying_register_fake_if_ops(")
        src = src.replace(target, guarded)
    helper = (
        f"\n{MARK}\n"
        "def _flying_register_fake_if_ops(name):\n"
        "    from torchvision.extension import _has_ops\n"
        "    if _has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n\n"
    )
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in src:
        raise RuntimeError(
            "torchvision/_meta_registrations.py changed shape; update worker_ext/cpu_compat/install.py"
        )
    return src.replace(anchor, helper + anchor, 1)


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("cpu_compat: torchvision not installed; nothing to guard")
        return 0
    path = Path(spec.origin).parent / "_meta_registrations.py"
    src = path.read_text()
    new = guard_source(src)
    if new != src:
        path.write_text(new)
        print(f"cpu_compat: guarded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
