"""verl's tool agent loop, plus the trajectory-end hook verl lacks: the broker sandboxes of a trajectory are deleted
when its ``run`` ends, however it ends.

verl makes one agent-loop object per trajectory and calls ``run`` once; ``BrokerShellTool`` records each
trajectory's sandbox in the ``trajectory_scope`` that ``run`` opens here. Importing this module registers the loop as
``tangram_tool_agent`` in verl's agent-loop registry; a rollout worker imports it through
``actor_rollout_ref.rollout.agent.agent_loop_config_path=`` the package's ``verl_agent_loop.yaml`` (its path printed
by ``python -m tangram_client.verl_paths``) and uses it with
``actor_rollout_ref.rollout.agent.default_agent_loop=tangram_tool_agent`` (or a sample's ``agent_name``).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from tangram_client.verl_tool import trajectory_scope

AGENT_NAME = "tangram_tool_agent"


@register(AGENT_NAME)
class TangramToolAgentLoop(ToolAgentLoop):
    """``ToolAgentLoop`` whose trajectory's broker sandboxes are deleted when ``run`` returns or raises."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        async with trajectory_scope():
            return await super().run(sampling_params, **kwargs)
