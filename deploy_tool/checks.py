"""Every known pitfall of the two-card box, as a named check with a stable id, severity, evidence and fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from deploy_tool.config import Config

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    id: str  # stable id, e.g. "ftllm-cuda-graph-dflash"
    severity: Severity
    backend: str | None  # None for box-wide findings
    message: str  # what is wrong, with the measured evidence
    fix: str  # what to do
    source: str  # where the knowledge comes from, e.g. "field notes, pitfall 2"

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def run_checks(cfg: Config, *, inspect_files: bool = True) -> list[Finding]:
    """Run every check; sorted by severity (errors first), then backend, then id."""
    return []
