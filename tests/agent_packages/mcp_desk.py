"""An agent whose tools come from an MCP server over stdio (the server is tests/mcp_server.py)."""

import os
import sys

from google.adk.agents import LlmAgent
from google.adk.tools.mcp_tool import McpToolset, StdioConnectionParams
from mcp import StdioServerParameters

SERVER = os.environ["LEDGER_TEST_MCP_SERVER"]

root_agent = LlmAgent(
    name="mcp_desk",
    model="gemini-2.5-flash",
    description="Reads and writes a ticket store through MCP.",
    tools=[
        McpToolset(
            connection_params=StdioConnectionParams(
                server_params=StdioServerParameters(command=sys.executable, args=[SERVER], env=dict(os.environ)),
                timeout=20,
            )
        )
    ],
)
