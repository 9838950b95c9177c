"""The one error type of workflow handling: the message names the node when there is one."""

from __future__ import annotations

from typing import Optional

from ..errors import SeedVR2Error


class WorkflowError(SeedVR2Error):
    """A workflow that cannot run: malformed, unknown node type, bad input, or a node's failure."""

    def __init__(self, message: str, node_id: Optional[str] = None,
                 class_type: Optional[str] = None):
        self.message, self.node_id, self.class_type = message, node_id, class_type
        kind = class_type if isinstance(class_type, str) and len(class_type) <= 60 and \
            class_type.isprintable() else repr(class_type)[:60]
        where = f"node {node_id} ({kind}): " if node_id is not None else ""
        super().__init__(where + message)


class WorkflowInterrupted(WorkflowError):
    """The run was interrupted; nothing partial was kept by our nodes."""
