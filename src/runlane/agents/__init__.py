"""Agent runners: the agent-command protocol (CONTRACT.md) and in-process agents."""
