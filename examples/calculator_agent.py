"""An agent written against the OpenAI API, trained as it is: it asks the model the tiny task's
question with a calculator tool, runs the tool calls the model makes, and returns 1.0 when the
model's final answer is right (configs/agent_cpu.yaml).

    env:
      kind: agent
      name: examples/calculator_agent.py:solve
      tool_parser: examples/calculator_agent.py:parse_tool_calls

Two forms of the same agent. `solve(client, example)` is handed a ready `openai.AsyncOpenAI`
at its episode's URL (envs.with_client). `solve_from_url(base_url, example)` makes its own
client, as the `openai` package's docs show; that works as well, but a new AsyncOpenAI builds
an SSL context first (about 35 ms), which `solve`'s shared client does not.
"""

import json
import re

from openai import AsyncOpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a sum of whole numbers, such as 3+4",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"\d+(\+\d+)*", expression):
        return "error"
    return str(sum(int(x) for x in expression.split("+")))


async def solve(client: AsyncOpenAI, example: dict) -> float:
    messages = [{"role": "user", "content": example["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(expression)})
    return float((message.content or "").strip() == example["answer"])


async def solve_from_url(base_url: str, example: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    return await solve(client, example)


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """The tiny model's tool-call format (tiny_task.CHAT_TEMPLATE): <tool_call>3+4</tool_call>,
    the calculator's expression alone."""
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    name = tools[0]["function"]["name"]
    return content.strip(), [{"name": name, "arguments": json.dumps({"expression": c})}
                             for c in calls]
