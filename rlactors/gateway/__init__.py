"""Agents as envs: an OpenAI Chat Completions gateway whose sessions are rollouts, and AgentEnv."""

from rlactors.gateway.agent_env import AgentEnv, serve_agent_env
from rlactors.gateway.server import Gateway, SessionInfo

__all__ = ["AgentEnv", "Gateway", "SessionInfo", "serve_agent_env"]
