"""What ``apply`` did to a model: the places it replaced and the places it left alone."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    """What ``apply`` replaced, as (module path, op) pairs, and what it left alone and why;
    with ``quantize="fp8"``, every Linear of the model as (path, "fp8 (...)" or "bf16: why")."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    linears: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ditops replaced {len(self.replaced)} places:"] + [f"  {path}: {op}" for path, op in self.replaced]
        lines += [f"  skipped {what}" for what in self.skipped]
        if self.linears:
            fp8 = sum(kind.startswith("fp8") for _, kind in self.linears)
            lines.append(f"Linear layers: {fp8} of {len(self.linears)} run FP8")
            lines += [f"  {path}: {kind}" for path, kind in self.linears]
        return "\n".join(lines)
