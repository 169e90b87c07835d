"""Where the verl configs of this package are, as installed (package data): ``python -m tangram_client.verl_paths``
prints verl's two overrides that name them, one a line, with absolute paths::

    actor_rollout_ref.rollout.multi_turn.tool_config_path=/.../tangram_client/verl_tool_config.yaml
    actor_rollout_ref.rollout.agent.agent_loop_config_path=/.../tangram_client/verl_agent_loop.yaml

so that ``$(python -m tangram_client.verl_paths)`` can go on a verl command line as it is."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the tool config: ``BrokerShellTool`` as verl's ``shell`` tool
TOOL_CONFIG = HERE / "verl_tool_config.yaml"
#: the agent-loop config: registers ``tangram_tool_agent``
AGENT_LOOP_CONFIG = HERE / "verl_agent_loop.yaml"
#: verl's option for each
OVERRIDES = {"actor_rollout_ref.rollout.multi_turn.tool_config_path": TOOL_CONFIG,
             "actor_rollout_ref.rollout.agent.agent_loop_config_path": AGENT_LOOP_CONFIG}


def main() -> None:
    for option, path in OVERRIDES.items():
        print(f"{option}={path}")


if __name__ == "__main__":
    main()
