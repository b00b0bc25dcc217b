"""Prompts beyond text: tools and template arguments for chat messages, and multimodal messages.

Tools and ``chat_template_kwargs`` reach the chat template exactly as vLLM's chat path passes
them, so they change the prompt's tokens and with them its keys. Media parts are keyed on their
hash in the block where the template places them (as vLLM keys multimodal blocks) and travel to
the engine on the request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prefixgate import Gateway, GatewayConfig, InvalidRequest, PromptTooLong
from prefixgate.keys import Namespace, block_hashes, media_extras
from prefixgate.sim import SimEngine
from prefixgate.testing import FakeEngine, FakeSamplingParams, NullEngine

SP = FakeSamplingParams(max_tokens=1)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather  in a city.",  # two spaces: never canonicalized
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": " ".join(["You are a helpful assistant."] * 4)}
# 1x1 PNGs, red and blue.
PNG_A = ("data:image/png;base64,"
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
PNG_B = ("data:image/png;base64,"
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYPgPAAEDAQAIicLsAAAAAElFTkSuQmCC")


def _image(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " Answer in one word."}]}]


async def _ticket(gw: Gateway, prompt, **kwargs):
    stream = gw.generate(prompt, SP, **kwargs)
    async for _ in stream:
        pass
    return stream.ticket


# -- tools and chat_template_kwargs ---------------------------------------------------------------


async def test_tools_and_template_kwargs_reach_the_template_and_change_the_key():
    engine = FakeEngine(block_size=4)
    messages = [SYSTEM, {"role": "user", "content": "Weather  in Paris?"}]
    async with Gateway(engine) as gw:
        plain = await _ticket(gw, messages)
        tools = await _ticket(gw, messages, tools=TOOLS)
        again = await _ticket(gw, messages, tools=TOOLS)
        thinking = await _ticket(gw, messages, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    tok = engine.tokenizer
    canonical = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]  # message text only
    for ticket, kwargs in ((plain, {}), (tools, {"tools": TOOLS}),
                           (thinking, {"tools": TOOLS, "enable_thinking": False})):
        expected = tok.apply_chat_template(canonical, tokenize=True, add_generation_prompt=True, **kwargs)
        assert list(ticket.prompt_token_ids) == expected
    assert '"Weather  in a city."' in tok.decode(tools.prompt_token_ids)  # the schema is untouched
    assert tools.block_hashes == again.block_hashes
    assert plain.block_hashes[0] != tools.block_hashes[0]  # tools render first: no block shared
    shared = len(tools.prompt_token_ids) - 1  # enable_thinking renders after the last message
    assert thinking.prompt_token_ids[:shared] == tools.prompt_token_ids[:shared]
    n = shared // 4
    assert thinking.block_hashes[:n] == tools.block_hashes[:n]
    assert thinking.block_hashes[n:] != tools.block_hashes[n:]
    assert [r.prompt_token_ids for r in engine.requests] == [
        t.prompt_token_ids for t in (plain, tools, again, thinking)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tools": {"type": "function"}}, "tools must be a list"),
    ({"tools": "get_weather"}, "tools must be a list"),
    ({"tools": [["get_weather"]]}, "tool 0 must be a mapping"),
    ({"chat_template_kwargs": [("enable_thinking", False)]}, "must be a mapping"),
    ({"chat_template_kwargs": {1: True}}, "non-empty strings"),
    ({"chat_template_kwargs": {"": True}}, "non-empty strings"),
    ({"chat_template_kwargs": {"tokenize": True}}, "may not set 'tokenize'"),
    ({"chat_template_kwargs": {"tools": TOOLS}}, "pass tools="),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "add_generation_prompt"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template"),
])
async def test_bad_tools_and_template_kwargs_are_invalid_at_the_call(kwargs, match):
    messages = [{"role": "user", "content": "hi"}]
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match=match):
            gw.generate(messages, SP, **kwargs)
        with pytest.raises(InvalidRequest, match=match):
            gw.try_generate(messages, SP, **kwargs)
        with pytest.raises(InvalidRequest, match=match):
            await gw.submit(messages, SP, **kwargs)
        assert not gw.can_admit(messages, SP, **kwargs)
        assert gw.can_admit(messages, SP)
        assert gw.statistics().refused == {"invalid": 3}


@pytest.mark.parametrize("prompt", ["hi there", b"hi there", [5, 6, 7], {"prompt_token_ids": [5, 6]}])
async def test_tools_and_template_kwargs_apply_to_chat_messages_only(prompt):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match="chat messages only"):
            gw.generate(prompt, SP, tools=TOOLS)
        with pytest.raises(InvalidRequest, match="chat messages only"):
            gw.generate(prompt, SP, chat_template_kwargs={"enable_thinking": False})


async def test_a_template_that_fails_on_the_arguments_is_invalid_at_the_call():
    class Strict(FakeEngine().tokenizer.__class__):
        def apply_chat_template(self, conversation, *, tools=None, **kwargs):
            if kwargs.get("reasoning_effort") not in (None, "low", "high"):
                raise ValueError("reasoning_effort must be low or high")
            return super().apply_chat_template(conversation, tools=tools, **kwargs)

    async with Gateway(FakeEngine(tokenizer=Strict())) as gw:
        with pytest.raises(InvalidRequest, match="low or high"):
            gw.generate([{"role": "user", "content": "hi"}], SP,
                        chat_template_kwargs={"reasoning_effort": "max"})
        await _ticket(gw, [{"role": "user", "content": "hi"}],
                      chat_template_kwargs={"reasoning_effort": "low"})


TOKENIZER = AutoTokenizer.from_pretrained(str(Path(__file__).parent / "fixtures" / "tiny-llama"))


@pytest.mark.parametrize("ingress", ["threads", "processes"])
async def test_every_ingress_mode_prepares_tools_and_media_as_inline_does(ingress):
    long_system = {"role": "system", "content": "A shared  system prompt, repeated.\n" * 60}
    prompts = [
        ([long_system, {"role": "user", "content": f"question {i}"}],
         {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": bool(i % 2)}})
        for i in range(4)
    ] + [([long_system, *_image(url)[1:]], {}) for url in (PNG_A, PNG_B)]

    async def tickets(mode: str) -> tuple[list, int]:
        engine = NullEngine(tokenizer=TOKENIZER, max_model_len=4096)
        async with Gateway(engine, GatewayConfig(ingress=mode)) as gw:
            streams = [gw.generate(p, SP, **kw) for p, kw in prompts]
            assert all(s.ticket is None for s in streams) or mode == "inline"
            for s in streams:
                async for _ in s:
                    pass
            return [s.ticket for s in streams], (gw._pool.prepared if gw._pool else 0)

    inline, _ = await tickets("inline")
    pooled, prepared = await tickets(ingress)
    assert prepared == len(prompts)
    for a, b in zip(inline, pooled, strict=True):
        assert list(a.prompt_token_ids) == list(b.prompt_token_ids)
        assert a.block_hashes == b.block_hashes and a.media == b.media
    expected = TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "A shared system prompt, repeated.\n" * 60},
         {"role": "user", "content": "question 0"}],
        tools=TOOLS, enable_thinking=False, add_generation_prompt=True, tokenize=False)
    assert list(inline[0].prompt_token_ids) == TOKENIZER.encode(expected, add_special_tokens=False)
    assert inline[0].block_hashes != inline[1].block_hashes  # enable_thinking differs
    assert inline[4].media[0].position == inline[5].media[0].position > 0
    n = inline[4].media[0].position // 16  # NullEngine blocks
    assert inline[4].block_hashes[:n] == inline[5].block_hashes[:n]
    assert inline[4].block_hashes[n] != inline[5].block_hashes[n]


# -- multimodal messages --------------------------------------------------------------------------


async def test_media_are_keyed_where_the_template_places_them():
    engine = FakeEngine(block_size=4)
    async with Gateway(engine) as gw:
        a = await _ticket(gw, _image(PNG_A))
        a2 = await _ticket(gw, _image(PNG_A))
        b = await _ticket(gw, _image(PNG_B))
        text = await _ticket(gw, [SYSTEM, {"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "text", "text": " Answer in one word."}]}])
    tok = engine.tokenizer
    assert tok.decode(a.prompt_token_ids) == tok.decode(b.prompt_token_ids) == (
        f"<system>{SYSTEM['content']}\n<user>What is in this picture?<image> Answer in one word.\n"
        "<assistant>")
    (ma,), (mb,) = a.media, b.media
    position = len(f"<system>{SYSTEM['content']}\n<user>What is in this picture?")
    assert ma.position == mb.position == position and ma.modality == "image" and ma.data == PNG_A
    assert ma.identifier != mb.identifier and a2.media == a.media
    assert a2.block_hashes == a.block_hashes  # same image, same keys
    first = position // 4  # the block the image sits in
    assert a.block_hashes[:first] == b.block_hashes[:first] == text.block_hashes[:first]
    assert all(x != y for x, y in zip(a.block_hashes[first:], b.block_hashes[first:], strict=True))
    assert a.block_hashes[first] != text.block_hashes[first]
    assert engine.requests[0].media == a.media and engine.requests[3].media is None


async def test_two_media_items_and_raw_bytes():
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
    content = [{"type": "image", "image": png}, {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": PNG_A}]  # the URL as a bare string is accepted too
    async with Gateway(FakeEngine(block_size=4)) as gw:
        t = await _ticket(gw, [{"role": "user", "content": content}])
        swapped = await _ticket(gw, [{"role": "user", "content": [
            {"type": "image", "image": bytearray(png)}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": PNG_B}}]}])
    first, second = t.media
    assert (first.modality, first.data, first.position) == ("image", png, len("<user>"))
    assert second.position == len("<user><image>and")
    assert swapped.media[0] == first  # equal bytes, equal item
    assert swapped.media[1].identifier != second.identifier
    n = second.position // 4
    assert swapped.block_hashes[:n] == t.block_hashes[:n] and swapped.block_hashes[n] != t.block_hashes[n]


@pytest.mark.parametrize(("part", "match"), [
    ({"type": "image_url", "image_url": {}}, "needs a non-empty 'url'"),
    ({"type": "image_url", "image_url": {"url": ""}}, "needs a non-empty 'url'"),
    ({"type": "image", "image": "not bytes"}, "non-empty bytes"),
    ({"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}}, "unsupported content part"),
    ({"type": 3}, "'type' must be a string"),
])
async def test_malformed_media_parts_are_invalid_at_the_call(part, match):
    async with Gateway(FakeEngine()) as gw:
        with pytest.raises(InvalidRequest, match=match):
            gw.generate([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], SP)


def test_media_extras_mirror_vllm_extra_keys():
    a, b = "0" * 32, "f" * 32
    extras = media_extras([(5, a), (7, b), (20, a)], 4)
    assert extras == {1: bytes(16) + (1).to_bytes(4, "little") + bytes.fromhex(b) + (3).to_bytes(4, "little"),
                      5: bytes(16) + bytes(4)}
    assert media_extras([(5, a), (20, a)], 4, start=2) == {3: bytes(16) + bytes(4)}
    ns = Namespace("m")
    ids = list(range(2, 30))
    plain, with_media = block_hashes(ids, 4, ns), block_hashes(ids, 4, ns, media=[(5, a)])
    assert plain[0] == with_media[0] and all(x != y for x, y in zip(plain[1:], with_media[1:], strict=True))
    # Extending a chain over more tokens keeps the media in the blocks already known.
    longer, media = ids + [9] * 8, [(5, a), (30, b)]
    whole = block_hashes(longer, 4, ns, media=media)
    assert block_hashes(longer, 4, ns, known=with_media[:3], media=media) == whole
    assert block_hashes(longer, 4, ns, media=media)[:7] == with_media


async def test_the_simulator_keys_media_as_the_gateway_predicts():
    sim = SimEngine(block_size=4, num_blocks=512, max_model_len=1024)
    async with Gateway(sim, GatewayConfig(), clock=sim.clock) as gw:
        first = await _ticket(gw, _image(PNG_A))
        same = await _ticket(gw, _image(PNG_A))
        other = await _ticket(gw, _image(PNG_B))
        await asyncio.sleep(0)
    assert same.cached_tokens == same.predicted_hit_tokens == 4 * same.cacheable_blocks
    position = first.media[0].position
    assert other.cached_tokens == other.predicted_hit_tokens == 4 * (position // 4)


async def test_bounds_on_rendered_chats_and_media_items():
    async with Gateway(FakeEngine(max_model_len=256)) as gw:  # 255 tokens: 16,320 characters
        huge_tools = [{"type": "function", "function": {"name": "f", "description": "x" * 20_000}}]
        with pytest.raises(PromptTooLong, match="rendered chat"):
            gw.generate([{"role": "user", "content": "hi"}], SP, tools=huge_tools)
        many = [{"type": "image_url", "image_url": f"https://example.com/{i}.png"} for i in range(257)]
        with pytest.raises(InvalidRequest, match="257 media items"):
            gw.generate([{"role": "user", "content": many}], SP)


async def test_text_parts_reach_a_template_that_takes_strings_joined_by_newlines_as_in_vllm():
    # The tiny Llama's template prints m['content']: vLLM's "string" content format. vLLM joins
    # the text parts with newlines for it (and would put a multimodal model's own placeholder
    # text for each media item, which only the model knows: here media parts add no text).
    engine = NullEngine(tokenizer=TOKENIZER, max_model_len=4096)
    async with Gateway(engine, GatewayConfig(ingress="inline")) as gw:
        parts = await _ticket(gw, [{"role": "user", "content": [
            {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": PNG_A},
            {"type": "text", "text": "briefly"}]}])
        plain = await _ticket(gw, [{"role": "user", "content": "Describe\nbriefly"}])
    assert list(parts.prompt_token_ids) == list(plain.prompt_token_ids)
    prefix = TOKENIZER.encode("<s><|user|>\nDescribe", add_special_tokens=False)
    assert parts.media[0].position == len(prefix)
    assert gw._ingress.chat.takes_strings() and not Gateway(FakeEngine())._ingress.chat.takes_strings()
