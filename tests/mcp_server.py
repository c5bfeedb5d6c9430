"""A real MCP server over stdio for the tests: one read-only tool and one tool with an effect.

Written with the `mcp` package's server API (`MCPServer`, FastMCP's name in mcp 2.x). The
effect is a line appended to the file LEDGER_TEST_MCP_STORE names; with LEDGER_TEST_MCP_HANG
set, `close_ticket` does its effect and then waits that many seconds before answering (so a
test can kill the worker while the tool runs).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("tickets")


def _store() -> Path:
    return Path(os.environ["LEDGER_TEST_MCP_STORE"])


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def read_ticket(ticket_id: str) -> str:
    """Read a ticket. Reads only."""
    closed = _store().read_text().splitlines() if _store().exists() else []
    state = "closed" if any(line.startswith(f"{ticket_id} ") for line in closed) else "open"
    return f"ticket {ticket_id} is {state}"


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False))
def close_ticket(ticket_id: str, note: str) -> str:
    """Close a ticket with a note."""
    with _store().open("a") as store:
        store.write(f"{ticket_id} {note}\n")
    hang = float(os.environ.get("LEDGER_TEST_MCP_HANG") or 0)
    if hang:
        # Said where the test can find it: the server outlives a killed worker while it waits.
        _store().with_suffix(".pid").write_text(str(os.getpid()))
        time.sleep(hang)
    return f"ticket {ticket_id} closed"


if __name__ == "__main__":
    server.run()
