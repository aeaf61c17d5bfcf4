"""An agent whose tool the model cannot do without: the answer is a code, a digit drawn afresh
for each episode, and only the `lookup` tool tells it; the question (the tiny task's sum) says
nothing about it (configs/lookup_cpu.yaml).

    env:
      kind: agent
      name: examples/lookup_agent.py:solve
      tool_parser: examples/calculator_agent.py:parse_tool_calls   # <tool_call>...</tool_call>

The agent takes an answer only after a lookup, as a service that checks who asks would: the
model's first reply must call the tool, its second is its answer. (Without that rule a guess
scores one time in ten, as often as a lookup whose copy the model has not learnt yet; on the
tiny model the first replies' tool calls, which it writes half-formed at first, were unlearnt
within ten steps, and with them the only way to the code.)

`solve_broken` is the same agent with a tool that answers "error": the control, which cannot do
better than a guess (--env.name=examples/lookup_agent.py:solve_broken).
"""

import secrets

from openai import AsyncOpenAI

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The code of this episode, one digit",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


async def ask(client: AsyncOpenAI, example: dict, code: str, told: str) -> float:
    """The episode: the first reply must call `lookup`, which answers `told` to each call; the
    second reply is the answer, 1.0 when it is `code`."""
    messages = [{"role": "user", "content": example["prompt"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[LOOKUP])
    message = reply.choices[0].message
    if not message.tool_calls:
        return 0.0  # an answer before a lookup is not taken
    messages.append(message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": call.id, "content": told}
                 for call in message.tool_calls]
    reply = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[LOOKUP])
    return float((reply.choices[0].message.content or "").strip() == code)


async def solve(client: AsyncOpenAI, example: dict) -> float:
    code = str(secrets.randbelow(10))
    return await ask(client, example, code, told=code)


async def solve_broken(client: AsyncOpenAI, example: dict) -> float:
    return await ask(client, example, str(secrets.randbelow(10)), told="error")
