"""Real clients through the real edge against request shapes (docs/shapes.md): MCP, GraphQL, git and hostile bodies.

Modules: servers (the loopback TLS stand-ins: FastMCP over Streamable HTTP, graphql-core, git http-backend), world
(the shapes artifact, PKI and edge), test_mcp, test_graphql, test_git, test_hostile.
"""
