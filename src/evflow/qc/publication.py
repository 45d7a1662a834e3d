"""What a merger publishes: one merged object per path and cycle, with its completeness."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PublishedObject:
    """A merged QC object as a merger publishes it at the end of a cycle.

    ``path`` is ``qc/<task>/<object>``; ``completeness`` says which sources were seen,
    expected and missing in this cycle; ``created`` is unix time in seconds.
    """

    path: str
    task: str
    name: str
    run: int
    cycle: int
    obj: Any
    completeness: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    sequence: int = 0
    event_count: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
