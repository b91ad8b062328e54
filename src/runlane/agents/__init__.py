"""Agent runners: the agent-command protocol (README) and in-process agents."""
