"""Ways to collect a rollout beyond one-turn rounds: environments and their sandboxed Python tool,
agents that speak OpenAI through an endpoint over the engine, partial rollout."""
