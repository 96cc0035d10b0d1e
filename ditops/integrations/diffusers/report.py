"""What ``apply`` did to a model: the places it replaced and the places it left alone."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    """What ``apply`` replaced, as (module path, op) pairs, and what it left alone and why."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ditops replaced {len(self.replaced)} places:"] + [f"  {path}: {op}" for path, op in self.replaced]
        return "\n".join(lines + [f"  skipped {what}" for what in self.skipped])
