"""Agents for tests/workers/agent_endpoint.py, written against the real `openai` client: each
returns what it saw in its info, for the worker to check against the samples."""

import json

import openai
from openai import AsyncOpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "a sum of whole numbers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def _seen(reply) -> dict:
    choice = reply.choices[0]
    return {"logprobs": [t.logprob for t in choice.logprobs.content],
            "token_ids": choice.token_ids, "prompt_token_ids": reply.prompt_token_ids,
            "overridden": getattr(reply, "overridden", None), "finish": choice.finish_reason}


async def two_tools(base_url: str, example: dict):
    """Three calls, the first two answered by a tool call each, whose results go back."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        models = [m.id async for m in client.models.list()]
        messages, seen = [{"role": "user", "content": example["prompt"]}], []
        for k in range(3):
            reply = await client.chat.completions.create(
                model=models[0], messages=messages, tools=[CALCULATOR], logprobs=True,
                temperature=0.5, extra_body={"return_token_ids": True})
            message = reply.choices[0].message
            seen.append(_seen(reply))
            messages.append(message.model_dump(exclude_none=True))
            for call in (message.tool_calls or []) if k < 2 else []:
                expression = json.loads(call.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": str(sum(int(x) for x in expression.split("+")))})
        try:
            await client.chat.completions.create(model=models[0], messages=messages, stream=True)
            refused = None
        except openai.BadRequestError as e:
            refused = str(e)
    return 1.0, {"messages": messages, "seen": seen, "models": models, "refused": refused}


async def rewrites(base_url: str, example: dict):
    """Two calls; the second's history holds an assistant turn the model did not write."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": example["prompt"]}]
        await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        messages += [{"role": "assistant", "content": "5"},
                     {"role": "user", "content": example["prompt"]}]
        await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    return 0.5


async def stops(base_url: str, example: dict):
    """One call with a stop string."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": example["prompt"]}], stop=["+"],
            max_tokens=6, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    return 1.0, {"content": choice.message.content, "finish": choice.finish_reason,
                 "token_ids": choice.token_ids, "overridden": getattr(reply, "overridden", None)}


async def ready(client, example: dict):
    """The ready-client form: one call through the client the trainer hands over; what that
    client is, for the worker to check (the episode's URL, the HTTP client under it)."""
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": example["prompt"]}], max_tokens=4)
    return 1.0, {"kind": type(client).__name__, "base_url": str(client.base_url),
                 "http": id(client._client), "content": reply.choices[0].message.content}


async def refusals(base_url: str, example: dict):
    """A call under a base URL of no episode, one the endpoint cannot serve (stream), then
    calls until one is past env.max_turns: each refused, and what the client got."""
    got = []
    async with AsyncOpenAI(base_url=base_url.replace("/e/", "/e/nope"), api_key="unused",
                           max_retries=0) as stranger:
        try:
            await stranger.chat.completions.create(model="m", messages=[
                {"role": "user", "content": example["prompt"]}])
        except openai.NotFoundError:
            got.append("no_episode")
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": example["prompt"]}]
        try:
            await client.chat.completions.create(model="m", messages=messages, stream=True)
        except openai.BadRequestError:
            got.append("bad_request")
        for _ in range(5):
            try:
                await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
            except openai.BadRequestError:
                got.append("limit")
    return 1.0, {"got": got}
